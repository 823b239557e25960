//! Calls to a node agent's RPC service, as a driver or another node makes them.

use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse, NodeStatus};
use floe_core::wire::{RpcClient, WireConfig};

/// A client connection to the node at `addr`.
pub async fn connect(addr: &str, wire: &WireConfig) -> RpcClient<NodeProtocol> {
    RpcClient::connect(addr, wire.clone()).await.unwrap()
}

/// One call on a fresh connection.
pub async fn call(addr: &str, wire: &WireConfig, request: &NodeRequest) -> NodeResponse {
    connect(addr, wire).await.call(request).await.unwrap()
}

pub async fn status(addr: &str, wire: &WireConfig) -> NodeStatus {
    match call(addr, wire, &NodeRequest::Status).await {
        NodeResponse::Status(status) => *status,
        other => panic!("unexpected {other:?}"),
    }
}
