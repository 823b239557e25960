//! `floe token create | ls | revoke`: the client tokens in the tokens file
//! (`auth.tokens_file`, from the same configuration the servers run with). Servers re-read
//! the file when it changes, so no command here needs a restart. See docs/SECURITY.md.

use anyhow::Context;
use clap::Subcommand;
use floe_core::Config;
use floe_core::auth::{Scopes, TokensFile};

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Add a token and print it, once (the file keeps only its SHA-256).
    Create {
        /// A name for the token, to list and revoke it by.
        #[arg(long)]
        name: String,
        /// Comma-separated: read, submit, admin (each includes the ones before it).
        #[arg(long)]
        scopes: String,
    },
    /// Every token's name and scopes.
    Ls,
    /// Remove a token: servers refuse it from their next connection on.
    Revoke {
        /// The token's name.
        name: String,
    },
}

pub fn run(config: &Config, command: &TokenCommand) -> anyhow::Result<()> {
    let path = config.tokens_file();
    let load = || {
        TokensFile::load(&path)
            .with_context(|| format!("reading the tokens file {}", path.display()))
    };
    match command {
        TokenCommand::Create { name, scopes } => {
            let scopes = Scopes::parse(scopes)?;
            let mut tokens = load()?;
            let token = tokens.create(name, scopes.clone())?;
            tokens.save(&path)?;
            eprintln!(
                "token '{name}' ({scopes}) added to {}; it is shown only now:",
                path.display()
            );
            println!("{}", token.expose());
        }
        TokenCommand::Ls => {
            let tokens = load()?;
            if tokens.entries.is_empty() {
                eprintln!("no tokens in {}", path.display());
            }
            for entry in &tokens.entries {
                println!("{}\t{}", entry.name, entry.scopes);
            }
        }
        TokenCommand::Revoke { name } => {
            let mut tokens = load()?;
            tokens.revoke(name)?;
            tokens.save(&path)?;
            eprintln!("token '{name}' revoked in {}", path.display());
        }
    }
    Ok(())
}
