use super::*;

fn tokens_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("tokens")
}

#[test]
fn scopes_include_the_lower_ones_only() {
    let submit = Scopes::parse("submit").unwrap();
    assert!(submit.grants(Scope::Read));
    assert!(submit.grants(Scope::Submit));
    assert!(!submit.grants(Scope::Admin));
    assert!(Scopes::parse("read,bogus").is_err());
    assert!(Scopes::parse("").is_err());
    assert_eq!(
        Scopes::parse("submit, read").unwrap().to_string(),
        "read,submit"
    );
}

#[test]
fn tickets_verify_only_for_their_node_and_secret() {
    let secret = ReplicaSecret::new("replica-secret");
    let ticket = NodeTicket::issue(&secret, NodeId::new(3));
    assert!(ticket.is_valid(&secret, NodeId::new(3)));
    assert!(!ticket.is_valid(&secret, NodeId::new(4)));
    assert!(!ticket.is_valid(&ReplicaSecret::new("other"), NodeId::new(3)));
    assert!(!ticket.is_valid(&ReplicaSecret::default(), NodeId::new(3)));
    assert!(!NodeTicket("zz".into()).is_valid(&secret, NodeId::new(3)));
}

#[test]
fn a_created_token_is_stored_as_a_hash_and_found_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = tokens_path(&dir);
    let mut file = TokensFile::load(&path).unwrap();
    let token = file
        .create("ci", Scopes::parse("read,submit").unwrap())
        .unwrap();
    assert!(matches!(
        file.create("ci", Scopes::parse("read").unwrap()),
        Err(AuthError::Duplicate(_))
    ));
    file.save(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        !text.contains(token.expose()),
        "the token itself must not be stored"
    );
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let reread = TokensFile::load(&path).unwrap();
    assert_eq!(reread.find(&token).map(|e| e.name.as_str()), Some("ci"));
    assert!(reread.find(&ClientToken::new("floe_wrong")).is_none());
    assert!(reread.find(&ClientToken::default()).is_none());
}

#[test]
fn malformed_lines_are_refused_with_their_line_number() {
    let path = Path::new("/x/tokens");
    let error = TokensFile::parse(path, "# c\n\nci read\n").unwrap_err();
    assert!(error.to_string().contains("line 3"), "{error}");
    let hash = "a".repeat(64);
    assert!(TokensFile::parse(path, &format!("ci write {hash}\n")).is_err());
    assert!(TokensFile::parse(path, &format!("ci read {hash}\nci read {hash}\n")).is_err());
    assert!(TokensFile::parse(path, "ci read abc\n").is_err());
}

#[test]
fn the_authenticator_tells_roles_apart_by_credential() {
    let dir = tempfile::tempdir().unwrap();
    let path = tokens_path(&dir);
    let cluster = ClusterSecret::new("cluster");
    let replica = ReplicaSecret::new("replica");
    let on_replica = Authenticator::new(cluster.clone(), Some(replica.clone()), path.clone());
    let on_node = Authenticator::new(cluster.clone(), None, path.clone());
    let member = Credential::Member {
        secret: cluster.clone(),
    };
    assert_eq!(on_replica.verify(&member), Ok(Principal::Member));
    let wrong = Credential::Member {
        secret: ClusterSecret::new("guess"),
    };
    assert!(on_replica.verify(&wrong).is_err());
    let node = Credential::Node {
        secret: cluster.clone(),
        id: NodeId::new(2),
        ticket: on_replica.issue_ticket(NodeId::new(2)).unwrap(),
    };
    assert_eq!(
        on_replica.verify(&node),
        Ok(Principal::Node(NodeId::new(2)))
    );
    assert_eq!(on_node.verify(&node), Ok(Principal::Member));
    assert!(on_node.issue_ticket(NodeId::new(2)).is_none());
    let forged = Credential::Node {
        secret: cluster.clone(),
        id: NodeId::new(5),
        ticket: on_replica.issue_ticket(NodeId::new(2)).unwrap(),
    };
    assert!(on_replica.verify(&forged).is_err());
    let as_replica = Credential::Replica {
        id: 2,
        secret: replica.clone(),
    };
    assert_eq!(on_replica.verify(&as_replica), Ok(Principal::Replica(2)));
    assert!(on_node.verify(&as_replica).is_err());
    let claims_replica = Credential::Replica {
        id: 2,
        secret: ReplicaSecret::new(cluster.expose()),
    };
    assert!(on_replica.verify(&claims_replica).is_err());
}

#[test]
fn tokens_are_reread_when_the_file_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = tokens_path(&dir);
    let auth = Authenticator::new(ClusterSecret::new("c"), None, path.clone());
    let mut file = TokensFile::default();
    let old = file.create("old", Scopes::parse("read").unwrap()).unwrap();
    file.save(&path).unwrap();
    assert!(matches!(
        auth.verify(&Credential::Client { token: old.clone() }),
        Ok(Principal::Client { ref name, .. }) if name == "old"
    ));
    let new = file.create("new", Scopes::parse("admin").unwrap()).unwrap();
    file.revoke("old").unwrap();
    assert!(file.revoke("old").is_err());
    file.save(&path).unwrap();
    assert!(
        auth.verify_token(&old).is_err(),
        "a revoked token must stop working"
    );
    let principal = auth.verify_token(&new).unwrap();
    assert!(principal.has_scope(Scope::Admin));
    // A broken file refuses everyone rather than keeping revoked tokens alive.
    std::fs::write(&path, "garbage\n").unwrap();
    assert!(auth.verify_token(&new).is_err());
}
