//! Calls from the HTTP API to node agents, as a cluster member, each bounded in time so one
//! slow node never holds a page.

use std::time::Duration;

use floe_api::node_protocol::{NodeProtocol, NodeRequest, NodeResponse};
use floe_core::NodeId;
use floe_core::wire::{RpcClient, WireConfig};

/// How long one node may take to answer; a slow node is reported, not waited for.
pub(super) const NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `request` to every node of `nodes` at once; each answer or why there is none, in
/// the order they come.
pub(super) async fn call_all(
    nodes: Vec<(NodeId, String)>,
    wire: &WireConfig,
    request: &NodeRequest,
) -> Vec<(NodeId, Result<NodeResponse, String>)> {
    let mut calls = tokio::task::JoinSet::new();
    for (node, addr) in nodes {
        let wire = wire.clone();
        let request = request.clone();
        calls.spawn(async move {
            let answer = tokio::time::timeout(NODE_TIMEOUT, async {
                let mut client: RpcClient<NodeProtocol> = RpcClient::connect(addr, wire).await?;
                client.call(&request).await
            })
            .await;
            let answer = match answer {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err(format!("no answer within {NODE_TIMEOUT:?}")),
            };
            (node, answer)
        });
    }
    let mut answers = Vec::new();
    while let Some(joined) = calls.join_next().await {
        match joined {
            Ok(answer) => answers.push(answer),
            Err(error) => tracing::warn!(%error, "a call to a node ended early"),
        }
    }
    answers
}
