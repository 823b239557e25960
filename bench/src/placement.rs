//! `floe-bench placement`: the leader's placement decisions against 1,000 simulated nodes
//! (16 CPUs and a 64 GiB heap pool each), in batches of 100 requests of 0.1 CPU and a
//! 256 MiB memory hint. After each batch its reservations are released, so the cluster stays
//! in a steady, partly used state instead of filling up. Figures: `placements_per_s` for each
//! strategy and for a mix of all of them (medians of several runs).

use std::time::{Duration, Instant};

use floe_api::placement::{Decision, PlacementRequest, ResourceView, Strategy};
use floe_api::state::Resources;
use floe_core::NodeId;

use super::{median_time, print_figure};

const NODES: u64 = 1_000;
const BATCH: usize = 100;
/// Work already running, so utilization is spread out rather than zero everywhere.
const BACKGROUND_TASKS: u64 = 20_000;

pub fn run(quick: bool) -> anyhow::Result<()> {
    let (placements, runs) = if quick { (20_000, 3) } else { (500_000, 5) };
    let labels = [("nodes", NODES.into()), ("batch", BATCH.into())];
    for (name, strategy) in [
        ("spread", Mix::Only(Strategy::Spread)),
        ("default", Mix::Only(Strategy::Default)),
        ("affinity", Mix::Affinity),
        ("mixed", Mix::All),
    ] {
        let time = median_time(runs, || place_all(placements, strategy))?;
        let rate = placements as f64 / time.as_secs_f64();
        let mut labels = labels.to_vec();
        labels.push(("strategy", name.into()));
        print_figure("placement", "placements_per_s", rate, "1/s", &labels);
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Mix {
    Only(Strategy),
    /// Soft affinity to a node derived from the request's number.
    Affinity,
    /// Spread, default with preferred inputs, and soft affinity in turn.
    All,
}

fn node(n: u64) -> NodeId {
    NodeId::new(n % NODES + 1)
}

fn request(n: u64, mix: Mix) -> PlacementRequest {
    let affinity = Strategy::NodeAffinity {
        node: node(n * 7),
        soft: true,
    };
    let strategy = match mix {
        Mix::Only(strategy) => strategy,
        Mix::Affinity => affinity,
        Mix::All => [Strategy::Spread, Strategy::Default, affinity][(n % 3) as usize],
    };
    PlacementRequest {
        cpu_millis: 100,
        memory_hint: 256 << 20,
        strategy,
        preferred: vec![(node(n * 13), 1 << 20), (node(n * 17), 2 << 20)],
        requester: Some(node(n)),
    }
}

fn cluster() -> ResourceView {
    let mut view = ResourceView::new();
    for n in 1..=NODES {
        view.upsert_node(
            NodeId::new(n),
            Resources {
                cpu_millis: 16_000,
                heap_bytes: 64 << 30,
            },
        );
    }
    let background: Vec<PlacementRequest> = (0..BACKGROUND_TASKS)
        .map(|n| request(n, Mix::Only(Strategy::Spread)))
        .collect();
    view.place(&background);
    view
}

fn place_all(placements: usize, mix: Mix) -> anyhow::Result<Duration> {
    let mut view = cluster();
    let batches: Vec<Vec<PlacementRequest>> = (0..placements.div_ceil(BATCH))
        .map(|batch| {
            (0..BATCH)
                .map(|i| request((batch * BATCH + i) as u64, mix))
                .collect()
        })
        .collect();
    let started = Instant::now();
    for batch in &batches {
        for (decision, request) in view.place(batch).into_iter().zip(batch) {
            match decision {
                Ok(Decision::Placed(node)) => {
                    view.release(node, request.cpu_millis, request.memory_hint);
                }
                other => anyhow::bail!("a steady-state request was not placed: {other:?}"),
            }
        }
    }
    Ok(started.elapsed())
}
