//! Who a peer is: the credentials each role holds, how a server verifies them, and the
//! verified [`Principal`] handlers authorize against.
//!
//! Three roles, each with its own credential (docs/SECURITY.md):
//! - members (replicas and nodes) share the [`ClusterSecret`];
//! - replicas alone hold the [`ReplicaSecret`], which authenticates Raft peers and keys the
//!   [`NodeTicket`]s the leader hands a node when it registers, so any replica verifies a
//!   node's claim to its id without state;
//! - clients hold [`ClientToken`]s with [`Scope`]s, listed by name and SHA-256 in a
//!   [`TokensFile`] that servers re-read when it changes.
//!
//! The role always comes from the credential the server verified, never from the peer's word.

use std::collections::BTreeSet;
use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::NodeId;

/// Errors of the tokens file.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot {action} the tokens file {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tokens file {}, line {line}: {problem}", path.display())]
    Malformed {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("a token named {0:?} already exists; revoke it first or pick another name")]
    Duplicate(String),
    #[error("no token named {0:?}")]
    NoSuchToken(String),
    #[error("bad token name {0:?}: use letters, digits, '-', '_' or '.'")]
    BadName(String),
    #[error("unknown scope {0:?}; the scopes are read, submit and admin")]
    UnknownScope(String),
    #[error("the operating system has no randomness to offer: {0}")]
    Random(String),
}

macro_rules! secret_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(secret: impl Into<String>) -> Self {
                Self(secret.into())
            }

            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }

            pub fn as_bytes(&self) -> &[u8] {
                self.0.as_bytes()
            }

            /// The secret itself, to hand to a process that needs it; never log it.
            pub fn expose(&self) -> &str {
                &self.0
            }

            /// Whether `other` is this secret, in time that does not depend on where they
            /// differ. An empty secret matches nothing.
            pub fn matches(&self, other: &Self) -> bool {
                !self.0.is_empty() && bool::from(self.0.as_bytes().ct_eq(other.0.as_bytes()))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let shown = if self.0.is_empty() { "<empty>" } else { "<redacted>" };
                write!(f, "{}({shown})", stringify!($name))
            }
        }
    };
}

secret_type!(
    /// `cluster.secret`: what replicas and nodes share and clients never get. `Debug` never
    /// prints it.
    ClusterSecret
);
secret_type!(
    /// `scheduler.replica_secret`: only replicas hold it. It authenticates Raft peers and keys
    /// node tickets.
    ReplicaSecret
);
secret_type!(
    /// `client.token`: a client's bearer token; the servers know only its SHA-256.
    ClientToken
);
secret_type!(
    /// A `[storage]` credential (an object store's secret key, session token or account
    /// key): handed to the object-store client only.
    StorageSecret
);

/// Proof that the leader registered a node under an id: HMAC-SHA256 of the id keyed with the
/// replica secret, in hex.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTicket(String);

impl fmt::Debug for NodeTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NodeTicket(<redacted>)")
    }
}

const TICKET_DOMAIN: &[u8] = b"floe node ticket v1\0";

fn ticket_mac(secret: &ReplicaSecret, node: NodeId) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(TICKET_DOMAIN);
    mac.update(&node.get().to_be_bytes());
    mac
}

impl NodeTicket {
    pub fn issue(secret: &ReplicaSecret, node: NodeId) -> Self {
        Self(hex(&ticket_mac(secret, node).finalize().into_bytes()))
    }

    /// Whether this ticket was issued for `node` under `secret` (compared in constant time).
    pub fn is_valid(&self, secret: &ReplicaSecret, node: NodeId) -> bool {
        let Some(bytes) = unhex(&self.0) else {
            return false;
        };
        !secret.is_empty() && ticket_mac(secret, node).verify_slice(&bytes).is_ok()
    }
}

/// What a client token allows; each scope includes the ones before it
/// (`admin` ⊇ `submit` ⊇ `read`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Scope {
    /// Reads: jobs, nodes, cache, progress, and result objects on the nodes.
    Read,
    /// Submitting, cancelling and deleting jobs.
    Submit,
    /// Cluster administration: cleaning the cache.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Submit, Scope::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Submit => "submit",
            Scope::Admin => "admin",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Scope {
    type Err = AuthError;

    fn from_str(text: &str) -> Result<Self, AuthError> {
        Scope::ALL
            .into_iter()
            .find(|scope| scope.name() == text)
            .ok_or_else(|| AuthError::UnknownScope(text.to_owned()))
    }
}

/// The scopes a token was given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Scopes(BTreeSet<Scope>);

impl Scopes {
    pub fn new(scopes: impl IntoIterator<Item = Scope>) -> Self {
        Self(scopes.into_iter().collect())
    }

    /// Whether these scopes include `wanted` (a higher scope includes the lower ones).
    pub fn grants(&self, wanted: Scope) -> bool {
        self.0.iter().any(|held| *held >= wanted)
    }

    /// Parses `read,submit`.
    pub fn parse(text: &str) -> Result<Self, AuthError> {
        let scopes = text
            .split(',')
            .map(str::trim)
            .filter(|part| !part.is_empty())
            .map(str::parse)
            .collect::<Result<BTreeSet<Scope>, AuthError>>()?;
        if scopes.is_empty() {
            return Err(AuthError::UnknownScope(text.to_owned()));
        }
        Ok(Self(scopes))
    }
}

impl fmt::Display for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|scope| scope.name()).collect();
        f.write_str(&names.join(","))
    }
}

/// Who the server verified a peer to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// A client token holder.
    Client { name: String, scopes: Scopes },
    /// A holder of the cluster secret that has not proven more: a node before it registered,
    /// or any member talking to a server that cannot check tickets (a node).
    Member,
    /// A registered node, proven by its ticket.
    Node(NodeId),
    /// A scheduler replica, proven by the replica secret.
    Replica(u64),
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Principal::Client { name, .. } => write!(f, "token '{name}'"),
            Principal::Member => f.write_str("an unregistered member"),
            Principal::Node(node) => write!(f, "node {node}"),
            Principal::Replica(id) => write!(f, "replica {id}"),
        }
    }
}

impl Principal {
    /// Whether the principal is a client token holder with `scope`.
    pub fn has_scope(&self, scope: Scope) -> bool {
        matches!(self, Principal::Client { scopes, .. } if scopes.grants(scope))
    }

    /// Whether the principal holds the cluster secret (a replica, a node, any member).
    pub fn is_member(&self) -> bool {
        match self {
            Principal::Member | Principal::Node(_) | Principal::Replica(_) => true,
            Principal::Client { .. } => false,
        }
    }
}

/// What a process presents in its handshake.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Credential {
    Client {
        token: ClientToken,
    },
    Member {
        secret: ClusterSecret,
    },
    Node {
        secret: ClusterSecret,
        id: NodeId,
        ticket: NodeTicket,
    },
    Replica {
        id: u64,
        secret: ReplicaSecret,
    },
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credential::Client { .. } => f.write_str("Credential::Client"),
            Credential::Member { .. } => f.write_str("Credential::Member"),
            Credential::Node { id, .. } => write!(f, "Credential::Node({id})"),
            Credential::Replica { id, .. } => write!(f, "Credential::Replica({id})"),
        }
    }
}

impl Credential {
    /// Whether the credential carries no secret at all (a misconfigured process).
    pub fn is_empty(&self) -> bool {
        match self {
            Credential::Client { token } => token.is_empty(),
            Credential::Member { secret } | Credential::Node { secret, .. } => secret.is_empty(),
            Credential::Replica { secret, .. } => secret.is_empty(),
        }
    }
}

/// The credential a process presents, shared by all its connections. A node's changes when it
/// registers; connections opened before that reconnect (see `RpcClient`).
#[derive(Clone)]
pub struct Identity(Arc<RwLock<(u64, Credential)>>);

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({:?})", self.current().1)
    }
}

impl Identity {
    pub fn new(credential: Credential) -> Self {
        Self(Arc::new(RwLock::new((0, credential))))
    }

    /// The credential and its version (bumped by every [`Identity::set`]).
    pub fn current(&self) -> (u64, Credential) {
        match self.0.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn version(&self) -> u64 {
        self.current().0
    }

    /// Presents `credential` from now on, on every connection that shares this identity.
    pub fn set(&self, credential: Credential) {
        let mut guard = match self.0.write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        guard.0 += 1;
        guard.1 = credential;
    }
}

/// Why a credential was refused; the message is what the peer is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unauthenticated(pub String);

/// Verifies credentials for a server.
#[derive(Debug)]
pub struct Authenticator {
    cluster_secret: ClusterSecret,
    /// Set on replicas only: it verifies replicas and node tickets.
    replica_secret: Option<ReplicaSecret>,
    tokens: TokenStore,
}

impl Authenticator {
    pub fn new(
        cluster_secret: ClusterSecret,
        replica_secret: Option<ReplicaSecret>,
        tokens_file: PathBuf,
    ) -> Self {
        Self {
            cluster_secret,
            replica_secret: replica_secret.filter(|secret| !secret.is_empty()),
            tokens: TokenStore::new(tokens_file),
        }
    }

    pub fn cluster_secret(&self) -> &ClusterSecret {
        &self.cluster_secret
    }

    /// A ticket for `node`, when this process holds the replica secret.
    pub fn issue_ticket(&self, node: NodeId) -> Option<NodeTicket> {
        self.replica_secret
            .as_ref()
            .map(|secret| NodeTicket::issue(secret, node))
    }

    pub fn verify(&self, credential: &Credential) -> Result<Principal, Unauthenticated> {
        let wrong_secret = || {
            Unauthenticated(
                "wrong cluster secret: every replica and node of a cluster must use the same \
                 cluster.secret (FLOE_CLUSTER_SECRET)"
                    .into(),
            )
        };
        match credential {
            Credential::Client { token } => self.verify_token(token),
            Credential::Member { secret } => {
                if self.cluster_secret.matches(secret) {
                    Ok(Principal::Member)
                } else {
                    Err(wrong_secret())
                }
            }
            Credential::Node { secret, id, ticket } => {
                if !self.cluster_secret.matches(secret) {
                    return Err(wrong_secret());
                }
                match &self.replica_secret {
                    // A node cannot check tickets; the cluster secret makes the peer a member.
                    None => Ok(Principal::Member),
                    Some(replica_secret) if ticket.is_valid(replica_secret, *id) => {
                        Ok(Principal::Node(*id))
                    }
                    Some(_) => Err(Unauthenticated(format!(
                        "invalid ticket for node {id}: register again"
                    ))),
                }
            }
            Credential::Replica { id, secret } => match &self.replica_secret {
                Some(own) if own.matches(secret) => Ok(Principal::Replica(*id)),
                Some(_) => Err(Unauthenticated(format!(
                    "wrong replica secret from replica {id}: every replica must use the same \
                     scheduler.replica_secret"
                ))),
                None => Err(Unauthenticated(
                    "this server is not a scheduler replica and takes no replica credentials"
                        .into(),
                )),
            },
        }
    }

    /// Checks a client token against the tokens file (re-read when it changed).
    pub fn verify_token(&self, token: &ClientToken) -> Result<Principal, Unauthenticated> {
        self.tokens.verify(token)
    }
}

/// One line of the tokens file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenEntry {
    pub name: String,
    pub scopes: Scopes,
    /// SHA-256 of the token, in hex.
    pub sha256: String,
}

/// The tokens file: `name scopes sha256` per line, `#` comments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokensFile {
    pub entries: Vec<TokenEntry>,
}

/// The prefix of every generated token, so one found in a log or a repository is recognisable.
const TOKEN_PREFIX: &str = "floe_";

fn check_name(name: &str) -> Result<(), AuthError> {
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(AuthError::BadName(name.to_owned()))
    }
}

impl TokensFile {
    pub fn parse(path: &Path, text: &str) -> Result<Self, AuthError> {
        let mut entries: Vec<TokenEntry> = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let malformed = |problem: String| AuthError::Malformed {
                path: path.to_owned(),
                line: index + 1,
                problem,
            };
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, scopes, sha256] = fields[..] else {
                return Err(malformed(format!(
                    "expected `name scopes sha256`, found {} fields",
                    fields.len()
                )));
            };
            check_name(name).map_err(|error| malformed(error.to_string()))?;
            let scopes = Scopes::parse(scopes).map_err(|error| malformed(error.to_string()))?;
            if sha256.len() != 64 || unhex(sha256).is_none() {
                return Err(malformed(
                    "the third field must be the token's SHA-256 in hex".into(),
                ));
            }
            if entries.iter().any(|entry| entry.name == name) {
                return Err(malformed(format!("token {name:?} is listed twice")));
            }
            entries.push(TokenEntry {
                name: name.to_owned(),
                scopes,
                sha256: sha256.to_ascii_lowercase(),
            });
        }
        Ok(Self { entries })
    }

    /// Reads `path`; a missing file has no tokens.
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(path, &text),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(AuthError::Io {
                action: "read",
                path: path.to_owned(),
                source,
            }),
        }
    }

    /// Writes the file readable by its owner only, replacing it atomically.
    pub fn save(&self, path: &Path) -> Result<(), AuthError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let io = |action, source| AuthError::Io {
            action,
            path: path.to_owned(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|source| io("create the directory of", source))?;
        }
        let mut text = String::from("# floe client tokens: name scopes sha256(token)\n");
        for entry in &self.entries {
            text.push_str(&format!(
                "{} {} {}\n",
                entry.name, entry.scopes, entry.sha256
            ));
        }
        let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temporary)
            .map_err(|source| io("write", source))?;
        file.write_all(text.as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|source| io("write", source))?;
        std::fs::rename(&temporary, path).map_err(|source| io("replace", source))
    }

    /// Adds a token named `name` and returns it; only its hash is kept.
    pub fn create(&mut self, name: &str, scopes: Scopes) -> Result<ClientToken, AuthError> {
        check_name(name)?;
        if self.entries.iter().any(|entry| entry.name == name) {
            return Err(AuthError::Duplicate(name.to_owned()));
        }
        let token = ClientToken::new(format!("{TOKEN_PREFIX}{}", random_hex(32)?));
        self.entries.push(TokenEntry {
            name: name.to_owned(),
            scopes,
            sha256: sha256_hex(token.as_bytes()),
        });
        Ok(token)
    }

    pub fn revoke(&mut self, name: &str) -> Result<(), AuthError> {
        let before = self.entries.len();
        self.entries.retain(|entry| entry.name != name);
        if self.entries.len() == before {
            return Err(AuthError::NoSuchToken(name.to_owned()));
        }
        Ok(())
    }

    /// The entry whose hash is the token's, compared in constant time.
    pub fn find(&self, token: &ClientToken) -> Option<&TokenEntry> {
        if token.is_empty() {
            return None;
        }
        let presented = sha256_hex(token.as_bytes());
        let mut found = None;
        // Every entry is compared, so timing does not tell which one matched.
        for entry in &self.entries {
            if bool::from(entry.sha256.as_bytes().ct_eq(presented.as_bytes())) {
                found = Some(entry);
            }
        }
        found
    }
}

/// A new random secret (for the cluster and replica secrets `floe up` makes).
pub fn random_secret() -> Result<String, AuthError> {
    random_hex(32)
}

fn random_hex(bytes: usize) -> Result<String, AuthError> {
    let mut buffer = vec![0u8; bytes];
    getrandom::fill(&mut buffer).map_err(|error| AuthError::Random(error.to_string()))?;
    Ok(hex(&buffer))
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok())
        .collect()
}

/// The tokens file as last read, re-read when its modification time or size changes, so
/// tokens are added and revoked without a restart.
#[derive(Debug)]
struct TokenStore {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    /// (modification time, length) of the file read, `None` when it did not exist.
    stamp: Option<(SystemTime, u64)>,
    read_once: bool,
    /// The tokens, or why the file is unusable (then every client is refused).
    tokens: Result<TokensFile, String>,
}

impl TokenStore {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            loaded: Mutex::new(Loaded {
                stamp: None,
                read_once: false,
                tokens: Ok(TokensFile::default()),
            }),
        }
    }

    fn verify(&self, token: &ClientToken) -> Result<Principal, Unauthenticated> {
        let stamp = std::fs::metadata(&self.path).ok().map(|meta| {
            (
                meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                meta.len(),
            )
        });
        let mut loaded = match self.loaded.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if !loaded.read_once || loaded.stamp != stamp {
            loaded.tokens = TokensFile::load(&self.path).map_err(|error| {
                // Fail closed: a broken file must not keep a revoked token working.
                tracing::error!(%error, "refusing every client token until the tokens file is fixed");
                error.to_string()
            });
            loaded.stamp = stamp;
            loaded.read_once = true;
        }
        let tokens = loaded
            .tokens
            .as_ref()
            .map_err(|error| Unauthenticated(format!("client tokens are unusable: {error}")))?;
        tokens
            .find(token)
            .map(|entry| Principal::Client {
                name: entry.name.clone(),
                scopes: entry.scopes.clone(),
            })
            .ok_or_else(|| {
                Unauthenticated(
                    "unknown client token: use a token from `floe token create` (client.token, \
                     FLOE_CLIENT_TOKEN)"
                        .into(),
                )
            })
    }
}

#[cfg(test)]
mod tests;
