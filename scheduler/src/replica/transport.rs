//! The transport between replicas: one task per peer carries Raft messages to it, batching
//! whatever is queued into one RPC, and reports failures back to the Raft loop.

use std::time::Duration;

use floe_core::wire::{RpcClient, WireConfig};
use protobuf::Message as _;
use raft::SnapshotStatus;
use raft::prelude::{Message, MessageType};
use tokio::sync::mpsc;

use super::Input;
use crate::{Error, Result};
use floe_api::scheduler_protocol::{SchedulerProtocol, SchedulerRequest};

/// Largest batch of Raft messages sent to one peer in one RPC.
const MAX_MESSAGES_PER_SEND: usize = 1024;
/// Pause after a failed send to a peer, so a dead peer costs no busy loop.
const PEER_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Starts the task that carries Raft messages to one peer, batching whatever is queued into
/// one RPC. Failures are reported to Raft (which retransmits) and paced by a short pause.
pub(super) fn spawn_peer_sender(
    peer: u64,
    addr: String,
    wire: WireConfig,
    inputs: mpsc::Sender<Input>,
) -> mpsc::UnboundedSender<Message> {
    let (sender, mut queue) = mpsc::unbounded_channel::<Message>();
    tokio::spawn(async move {
        let mut client: Option<RpcClient<SchedulerProtocol>> = None;
        while let Some(first) = queue.recv().await {
            let mut batch = vec![first];
            while batch.len() < MAX_MESSAGES_PER_SEND {
                match queue.try_recv() {
                    Ok(message) => batch.push(message),
                    Err(_) => break,
                }
            }
            let has_snapshot = batch
                .iter()
                .any(|message| message.get_msg_type() == MessageType::MsgSnapshot);
            let sent = send_batch(&mut client, &addr, &wire, &batch).await;
            if has_snapshot {
                let status = if sent.is_ok() {
                    SnapshotStatus::Finish
                } else {
                    SnapshotStatus::Failure
                };
                if inputs
                    .send(Input::SnapshotSent { peer, status })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if let Err(error) = sent {
                tracing::debug!(peer, %addr, %error, "cannot reach replica");
                client = None;
                if inputs.send(Input::Unreachable(peer)).await.is_err() {
                    return;
                }
                tokio::time::sleep(PEER_RETRY_PAUSE).await;
                // What queued up meanwhile is stale; Raft resends what still matters, but it
                // must hear that a snapshot was dropped or it would wait for it forever.
                let mut dropped_snapshot = false;
                while let Ok(message) = queue.try_recv() {
                    dropped_snapshot |= message.get_msg_type() == MessageType::MsgSnapshot;
                }
                if dropped_snapshot {
                    let status = SnapshotStatus::Failure;
                    if inputs
                        .send(Input::SnapshotSent { peer, status })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    });
    sender
}

async fn send_batch(
    client: &mut Option<RpcClient<SchedulerProtocol>>,
    addr: &str,
    wire: &WireConfig,
    batch: &[Message],
) -> Result<()> {
    let messages = batch
        .iter()
        .map(|message| {
            message.write_to_bytes().map_err(|error| Error::Protobuf {
                what: "message",
                message: error.to_string(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let connected = match client {
        Some(client) => client,
        None => client.insert(RpcClient::connect(addr, wire.clone()).await?),
    };
    connected.call(&SchedulerRequest::Raft { messages }).await?;
    Ok(())
}
