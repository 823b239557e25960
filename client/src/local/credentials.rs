//! The secrets and tokens of a local cluster: a cluster secret, a replica secret and a
//! tokens file holding an `admin` token, all generated for the cluster and handed to its
//! processes through their environment (never their command lines).

use std::path::{Path, PathBuf};
use std::process::Command;

use floe_core::auth::{
    AuthError, ClientToken, ClusterSecret, ReplicaSecret, Scopes, TokensFile, random_secret,
};
use floe_core::config::Config;
use floe_core::wire::WireConfig;

use super::{Error, Result};

/// The name of the admin token in a local cluster's tokens file.
pub const ADMIN_TOKEN_NAME: &str = "admin";

#[derive(Debug, Clone)]
pub struct LocalCredentials {
    pub cluster_secret: ClusterSecret,
    pub replica_secret: ReplicaSecret,
    /// The tokens file every replica and node of the cluster reads (mode 0600).
    pub tokens_file: PathBuf,
    /// A token with the `admin` scope, listed in `tokens_file`.
    pub admin_token: ClientToken,
}

fn auth_error(error: AuthError) -> Error {
    Error::Credentials(error.to_string())
}

impl LocalCredentials {
    /// New random secrets, and a tokens file `dir/tokens` with a new admin token.
    pub fn generate(dir: &Path) -> Result<Self> {
        let mut tokens = TokensFile::default();
        let admin_token = tokens
            .create(
                ADMIN_TOKEN_NAME,
                Scopes::new([floe_core::auth::Scope::Admin]),
            )
            .map_err(auth_error)?;
        let tokens_file = dir.join("tokens");
        tokens.save(&tokens_file).map_err(auth_error)?;
        Ok(Self {
            cluster_secret: ClusterSecret::new(random_secret().map_err(auth_error)?),
            replica_secret: ReplicaSecret::new(random_secret().map_err(auth_error)?),
            tokens_file,
            admin_token,
        })
    }

    /// A configuration holding these credentials, the admin token as `client.token`.
    pub fn config(&self) -> Config {
        let mut config = Config::default();
        config.cluster.secret = self.cluster_secret.clone();
        config.scheduler.replica_secret = self.replica_secret.clone();
        config.client.token = self.admin_token.clone();
        config.auth.tokens_file = self.tokens_file.clone();
        config
    }

    /// Presents the admin token.
    pub fn admin_wire(&self) -> WireConfig {
        WireConfig::client(&self.config())
    }

    /// Presents the cluster secret, as a node that has not registered.
    pub fn member_wire(&self) -> WireConfig {
        WireConfig::member(&self.config())
    }

    /// Gives a node process what it needs: the cluster secret and the tokens file.
    pub fn pass_to_node(&self, command: &mut Command) {
        command
            .env("FLOE_CLUSTER_SECRET", self.cluster_secret.expose())
            .env("FLOE_AUTH_TOKENS_FILE", &self.tokens_file);
    }

    /// Gives a replica process what it needs: a node's, and the replica secret.
    pub fn pass_to_replica(&self, command: &mut Command) {
        self.pass_to_node(command);
        command.env(
            "FLOE_SCHEDULER_REPLICA_SECRET",
            self.replica_secret.expose(),
        );
    }
}
