//! The scheduler client against a frozen replica: one that accepts connections (its kernel
//! does) but never answers, as a SIGSTOPped leader does.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_api::client::SchedulerClient;
use floe_api::scheduler_protocol::{SchedulerProtocol, SchedulerRequest, SchedulerResponse};
use floe_core::auth::ClusterSecret;
use floe_core::config::Config;
use floe_core::wire::{Handler, Peer, RemoteError, RpcServer, WireConfig};

/// A replica that answers every read with an empty state.
struct Answering;

impl Handler<SchedulerProtocol> for Answering {
    async fn handle(
        &self,
        _peer: Peer,
        request: SchedulerRequest,
    ) -> Result<SchedulerResponse, RemoteError> {
        match request {
            SchedulerRequest::ReadState => Ok(SchedulerResponse::State(Box::default())),
            other => panic!("unexpected request {other:?}"),
        }
    }
}

fn wire() -> WireConfig {
    let mut config = Config::default();
    config.cluster.secret = ClusterSecret::new("attempts");
    WireConfig::member(&config)
}

/// A listener whose connections are accepted by the kernel and never served.
async fn frozen() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    (listener, addr)
}

async fn answering() -> (RpcServer, String) {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = RpcServer::bind::<SchedulerProtocol, _>(any, Arc::new(Answering), wire())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

#[tokio::test]
async fn a_frozen_replica_costs_one_attempt_timeout_then_the_next_replica_answers() {
    let (_frozen, frozen_addr) = frozen().await;
    let (_server, answering_addr) = answering().await;
    let mut client = SchedulerClient::new(vec![frozen_addr, answering_addr], wire())
        .unwrap()
        .with_attempt_timeout(Duration::from_millis(300));
    let started = Instant::now();
    client.read_state().await.unwrap();
    // Without the bound the handshake alone waits `timeouts.handshake_ms` (5 s).
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[tokio::test]
async fn without_an_attempt_timeout_a_frozen_replica_holds_the_call_for_the_handshake() {
    let (_frozen, frozen_addr) = frozen().await;
    let (_server, answering_addr) = answering().await;
    let mut config = Config::default();
    config.cluster.secret = ClusterSecret::new("attempts");
    config.timeouts.handshake_ms = 1_500;
    let mut client = SchedulerClient::new(
        vec![frozen_addr, answering_addr],
        WireConfig::member(&config),
    )
    .unwrap();
    let started = Instant::now();
    client.read_state().await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(1_500));
}
