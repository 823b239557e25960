//! The same cluster as `tests/object_storage.rs`, but the S3 server's endpoint and keys come
//! from floe's configuration (`[storage]`, given to every process as settings) and not from
//! the environment: the client, the drivers and the workers (which the nodes hand the
//! settings to) all reach the server with them, and the keys show up in no job record, REST
//! answer or log.
#![allow(clippy::unwrap_used)]

#[path = "object_storage/shared.rs"]
mod shared;

use floe_core::config::{StorageConfig, StorageSecret};
use floe_testkit::s3::{ACCESS_KEY, S3Server, SECRET_KEY};

#[test]
fn credentials_from_the_configuration_reach_every_process_and_never_show() {
    let server = S3Server::start(&["lake"]);
    for (name, _) in server.env() {
        assert!(
            std::env::var_os(name).is_none(),
            "{name} is set; this test must get its credentials from the configuration only"
        );
    }
    let storage = StorageConfig {
        aws_access_key_id: ACCESS_KEY.to_owned(),
        aws_secret_access_key: StorageSecret::new(SECRET_KEY),
        aws_region: "us-east-1".to_owned(),
        aws_endpoint: server.endpoint(),
        aws_allow_http: true,
        ..StorageConfig::default()
    };
    // This process plans the jobs (lists objects, reads footers) as a client does.
    floe_engine::remote::configure(&storage);
    let settings: Vec<String> = storage
        .options()
        .into_iter()
        .map(|(key, value)| format!("storage.{key}={value}"))
        .collect();
    shared::a_cluster_reads_and_writes_s3_and_never_shows_the_keys(&server, &settings);
}
