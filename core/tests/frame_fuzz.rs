//! Fuzzing the frame decoder with proptest (runs in CI on stable Rust), with an allocator that
//! records the largest single allocation, to prove that no input makes the decoder allocate
//! past the frame limit.

// Helpers outside #[test] fns fail the test loudly when their set-up fails; that is the point.
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use floe_core::wire::handshake;
use floe_core::wire::rpc::{self, Protocol};
use floe_core::wire::{FramedStream, WireError};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

struct MeasuringAllocator;

thread_local! {
    /// The largest allocation made on this thread while measuring, or `None` when not measuring.
    static LARGEST: Cell<Option<usize>> = const { Cell::new(None) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping only
// touches a const-initialised thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for MeasuringAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn record(size: usize) {
    let _ = LARGEST.try_with(|largest| {
        if let Some(current) = largest.get() {
            largest.set(Some(current.max(size)));
        }
    });
}

#[global_allocator]
static ALLOCATOR: MeasuringAllocator = MeasuringAllocator;

/// Runs `work` and returns its result with the largest allocation it made on this thread.
fn measure<T>(work: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|largest| largest.set(Some(0)));
    let result = work();
    let largest = LARGEST.with(|largest| largest.replace(None)).unwrap_or(0);
    (result, largest)
}

struct Fuzzed;

#[derive(Debug, Serialize, Deserialize)]
enum FuzzRequest {
    Text(String),
    Items(Vec<Vec<u8>>),
    Pair(u64, Option<String>),
    Wide(Vec<[u64; 16]>),
}

impl Protocol for Fuzzed {
    const NAME: &'static str = "fuzz";
    type Request = FuzzRequest;
    type Response = FuzzRequest;
}

/// The smallest frame limit the configuration allows.
const MAX_FRAME: usize = 1 << 20;
const WAIT: Duration = Duration::from_millis(200);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// Feeds `input` to a frame reader and decodes every frame it yields as each message kind.
/// Returns how many frames were read.
fn decode_everything(runtime: &tokio::runtime::Runtime, input: &[u8]) -> usize {
    runtime.block_on(async {
        let (reader, mut writer) = tokio::io::duplex(input.len().max(1));
        writer.write_all(input).await.unwrap();
        drop(writer);
        let mut framed = FramedStream::new(reader, MAX_FRAME, WAIT, WAIT);
        let mut frames = 0;
        loop {
            match framed.recv(WAIT).await {
                Ok(body) => {
                    frames += 1;
                    let _ = handshake::decode_hello(body);
                    let _ = handshake::decode_reply(body, handshake::PROTOCOL_VERSION);
                    let _ = rpc::decode_request::<Fuzzed>(body);
                    let _ = rpc::decode_response::<Fuzzed>(body);
                }
                Err(
                    WireError::Closed
                    | WireError::Truncated { .. }
                    | WireError::FrameTooLarge { .. },
                ) => return frames,
                Err(other) => panic!("unexpected error kind for in-memory input: {other}"),
            }
        }
    })
}

/// Input that is mostly well-formed frames, so the decoders behind the framing get exercised.
fn framed_input() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        (
            prop::collection::vec(any::<u8>(), 0..300),
            prop_oneof![Just(None), any::<u32>().prop_map(Some)],
        ),
        0..6,
    )
    .prop_map(|frames| {
        let mut input = Vec::new();
        for (body, lie) in frames {
            let len = lie.unwrap_or(body.len() as u32);
            input.extend_from_slice(&len.to_be_bytes());
            input.extend_from_slice(&body);
        }
        input
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic_or_overallocate(input in prop::collection::vec(any::<u8>(), 0..2048)) {
        let runtime = runtime();
        let (_, largest) = measure(|| decode_everything(&runtime, &input));
        prop_assert!(largest <= MAX_FRAME, "allocated {largest} bytes");
    }

    #[test]
    fn framed_garbage_never_panics_or_overallocates(input in framed_input()) {
        let runtime = runtime();
        let (_, largest) = measure(|| decode_everything(&runtime, &input));
        prop_assert!(largest <= MAX_FRAME, "allocated {largest} bytes");
    }
}

#[test]
fn a_four_gigabyte_prefix_allocates_nothing_of_the_kind() {
    let runtime = runtime();
    let mut input = u32::MAX.to_be_bytes().to_vec();
    input.extend_from_slice(b"no body follows");
    let (frames, largest) = measure(|| decode_everything(&runtime, &input));
    assert_eq!(frames, 0);
    assert!(
        largest < 4096,
        "allocated {largest} bytes for a rejected prefix"
    );
}

#[test]
fn well_formed_frames_are_all_read() {
    let runtime = runtime();
    let mut input = Vec::new();
    for body in [&b"one"[..], b"", b"three"] {
        input.extend_from_slice(&(body.len() as u32).to_be_bytes());
        input.extend_from_slice(body);
    }
    let (frames, largest) = measure(|| decode_everything(&runtime, &input));
    assert_eq!(frames, 3);
    // Proves the measuring allocator sees the decoder's buffer at all.
    assert!(largest >= "three".len(), "largest allocation {largest}");
}

#[test]
fn a_lying_sequence_length_preallocates_at_most_the_frame_limit() {
    let runtime = runtime();
    // Request id, variant 3 (`Wide`), then a varint length of 2^40 elements of 128 bytes each.
    let mut body = vec![0u8; 8];
    body.push(3);
    body.push(253);
    body.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let mut input = (body.len() as u32).to_be_bytes().to_vec();
    input.extend_from_slice(&body);
    let (frames, largest) = measure(|| decode_everything(&runtime, &input));
    assert_eq!(frames, 1);
    assert!(
        largest <= MAX_FRAME,
        "allocated {largest} bytes for a 18-byte frame"
    );
}

/// `Not(Not(…(col("id"))))`, `depth` levels, in the codec's encoding, written by hand: building
/// the value and encoding it would recurse as deeply as the decoder is asked to.
fn not_chain_bytes(depth: usize) -> Vec<u8> {
    // Varint encoding: a variant index below 251 is one byte (`Not` is 3, `Column` 0), then
    // the column name's length and bytes.
    let mut bytes = vec![3u8; depth];
    bytes.extend_from_slice(&[0, 2, b'i', b'd']);
    bytes
}

/// A plan or expression nested far past the decoder's bound, as a hostile peer could send
/// it: refused with an error, where plain recursion would overflow the stack and abort.
#[test]
fn deeply_nested_plans_and_expressions_are_refused_not_overflowed() {
    use floe_core::expr::Expr;
    use floe_core::job::{JobOptions, JobSpec};
    use floe_core::plan::{LogicalPlan, MAX_PLAN_DEPTH, Operator};
    use floe_core::wire::codec;
    use floe_core::wire::nesting::MAX_DECODE_NESTING;

    let error = codec::decode::<Expr>(&not_chain_bytes(1_000_000), "expression").unwrap_err();
    assert!(error.to_string().contains("levels deep"), "{error}");
    // Just inside the bound, the same shape decodes.
    let depth = MAX_DECODE_NESTING as usize - 1;
    let shallow = codec::decode::<Expr>(&not_chain_bytes(depth), "expression").unwrap();
    assert_eq!(shallow.to_string().matches("not(").count(), depth);

    // A plan that deep cannot even be built (`plan_depth.rs` sends the bytes of one).
    let mut plan = LogicalPlan::new(Operator::Range { n: 10 }, vec![]).unwrap();
    for _ in 1..MAX_PLAN_DEPTH {
        plan = LogicalPlan::new(Operator::Limit { n: 5 }, vec![plan]).unwrap();
    }
    let spec = JobSpec {
        plan: plan.clone(),
        options: JobOptions::default(),
    };
    assert!(JobSpec::decode(&spec.encode().unwrap()).is_ok());
    let error = LogicalPlan::new(Operator::Limit { n: 5 }, vec![plan]).unwrap_err();
    assert!(error.to_string().contains("steps deep"), "{error}");
}
