//! Bad input at the doors of real processes: garbage on every port (the scheduler's RPC and
//! HTTP ports, each node's RPC port and worker socket), and a node with the wrong token. The
//! cluster must refuse it all, stay up, and then run a job correctly.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use floe_client::{Client, Dataset, col, lit};
use floe_core::auth::{ClusterSecret, Credential};
use floe_testkit::batches::int_column;
use floe_testkit::cluster::{TestCluster, TestClusterConfig, runtime, start_node};
use floe_testkit::process::is_running;

/// One scheduler replica and `nodes` nodes of two workers, all with `settings`.
fn cluster(runtime: &tokio::runtime::Runtime, nodes: usize, settings: &[&str]) -> TestCluster {
    let config = TestClusterConfig {
        settings: settings.iter().map(|s| (*s).to_owned()).collect(),
        ..TestClusterConfig::new(env!("CARGO_BIN_EXE_floe"))
    };
    runtime.block_on(TestCluster::start(config, nodes))
}

/// Bytes from a fixed seed, so a failure can be replayed.
fn garbage(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Sends `payload` and reads whatever comes back until the peer closes or goes quiet.
fn throw_at(addr: &str, payload: &[u8]) {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        panic!("{addr} does not accept connections");
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let _ = stream.write_all(payload);
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
}

/// A job whose answer is known: the ids below 30,000 divisible by 3, and their sum.
async fn check_a_job(client: &Client) {
    let dataset = Dataset::range(30_000)
        .unwrap()
        .filter((col("id") % lit(3i64)).eq(lit(0i64)))
        .unwrap();
    let output = client.submit(&dataset).await.unwrap().wait().await.unwrap();
    let ids = int_column(&output.to_arrow().await.unwrap(), "id");
    let expected: Vec<i64> = (0..30_000).filter(|id| id % 3 == 0).collect();
    assert_eq!(ids.len(), expected.len());
    assert_eq!(ids.iter().sum::<i64>(), expected.iter().sum::<i64>());
}

#[test]
fn garbage_on_every_port_is_refused_and_the_cluster_keeps_serving() {
    let runtime = runtime();
    let cluster = cluster(&runtime, 2, &[]);
    let schedulers = &cluster.schedulers;
    let nodes = [cluster.node(0), cluster.node(1)];

    let mut ports = vec![
        schedulers.addr(1).unwrap().to_owned(),
        schedulers.http_addr(1).unwrap().to_owned(),
    ];
    ports.extend(nodes.iter().map(|node| node.addr().to_owned()));
    let huge_frame = [0xff, 0xff, 0xff, 0xff, 0, 1, 2, 3];
    for (index, addr) in ports.iter().enumerate() {
        throw_at(addr, &garbage(64 << 10, index as u64 + 1));
        throw_at(addr, &huge_frame);
        throw_at(
            addr,
            b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
        );
        throw_at(addr, b"\x00");
    }
    for node in &nodes {
        let mut socket = UnixStream::connect(node.worker_socket()).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let _ = socket.write_all(&garbage(64 << 10, 99));
        let mut sink = [0u8; 4096];
        while matches!(socket.read(&mut sink), Ok(n) if n > 0) {}
    }

    for node in &nodes {
        assert!(is_running(node.pid()), "node {} died", node.addr());
    }
    assert!(schedulers.is_running(1));
    runtime.block_on(async {
        let client = Client::connect(&schedulers.addrs(), cluster.config.token())
            .await
            .unwrap();
        check_a_job(&client).await;
        let alive = client
            .cluster()
            .await
            .unwrap()
            .nodes
            .iter()
            .filter(|node| node.alive)
            .count();
        assert_eq!(alive, 2);
    });
}

#[test]
fn a_node_with_the_wrong_secret_is_refused_and_the_cluster_keeps_serving() {
    let runtime = runtime();
    let cluster = cluster(&runtime, 1, &[]);
    let schedulers = &cluster.schedulers;

    let mut wrong_token = cluster.config.clone();
    wrong_token.credentials.cluster_secret = ClusterSecret::new("not-the-secret");
    let dir = cluster.dir.path();
    let mut intruder = start_node(&wrong_token, dir, &schedulers.addrs(), "intruder", &[]);
    assert!(
        !intruder.wait().unwrap(),
        "a node with the wrong token kept running"
    );
    let log = std::fs::read_to_string(dir.join("intruder.log")).unwrap();
    assert!(log.contains("wrong cluster secret"), "{log}");

    runtime.block_on(async {
        let client = Client::connect(&schedulers.addrs(), cluster.config.token())
            .await
            .unwrap();
        let nodes = client.cluster().await.unwrap().nodes;
        assert_eq!(nodes.len(), 1, "the intruder registered: {nodes:?}");
        check_a_job(&client).await;
    });
}

/// The TCP sockets process `pid` listens on, as `(address, port)`, from /proc: each of its
/// socket descriptors matched by inode against the kernel's TCP tables.
fn listening_sockets(pid: u32) -> Vec<(std::net::IpAddr, u16)> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .collect();
    let mut sockets = Vec::new();
    for (table, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state (0A: LISTEN), inode.
            if fields.len() < 10 || fields[3] != "0A" || !inodes.iter().any(|i| i == fields[9]) {
                continue;
            }
            let (address, port) = fields[1].split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            let ip = if v6 {
                let mut bytes = [0u8; 16];
                for (word, chunk) in address.as_bytes().chunks(8).enumerate() {
                    let value =
                        u32::from_str_radix(std::str::from_utf8(chunk).unwrap(), 16).unwrap();
                    bytes[word * 4..word * 4 + 4].copy_from_slice(&value.to_ne_bytes());
                }
                std::net::IpAddr::from(bytes)
            } else {
                let value = u32::from_str_radix(address, 16).unwrap();
                std::net::IpAddr::from(value.to_ne_bytes())
            };
            sockets.push((ip, port));
        }
    }
    sockets
}

/// With the default `net.bind_host`, every port a scheduler replica and a node open (RPC,
/// HTTP) listens on loopback only.
#[test]
fn every_service_listens_on_loopback_by_default() {
    let runtime = runtime();
    let cluster = cluster(&runtime, 1, &[]);
    let (schedulers, node) = (&cluster.schedulers, cluster.node(0));
    let scheduler_ports = listening_sockets(schedulers.pid(1).unwrap());
    let node_ports = listening_sockets(node.pid());
    // The scheduler serves Raft/RPC and HTTP; the node serves its RPC.
    assert!(scheduler_ports.len() >= 2, "{scheduler_ports:?}");
    assert!(!node_ports.is_empty(), "{node_ports:?}");
    for (ip, port) in scheduler_ports.iter().chain(&node_ports) {
        assert!(ip.is_loopback(), "port {port} listens on {ip}");
    }
}

/// No HTTP endpoint or scheduler RPC can start a process: the scheduler crate, which serves
/// both, never spawns one (its `local` module is the test harness that starts replicas and is
/// not reachable from the network). Process UDFs run on nodes, behind the token, the
/// nodes' `node.udf_commands` and `node.udf_roots` (no inline code: `tests/process_udf.rs`).
#[test]
fn the_scheduler_serves_no_way_to_run_a_command() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest.join("scheduler/src");
    // The replica's own module in the binary (it starts the replica and parses specs) too.
    let mut pending = vec![root.clone(), manifest.join("src/scheduler.rs")];
    let mut checked = 0;
    while let Some(dir) = pending.pop() {
        let entries: Vec<std::path::PathBuf> = if dir.is_file() {
            vec![dir.clone()]
        } else {
            std::fs::read_dir(&dir)
                .unwrap()
                .map(|entry| entry.unwrap().path())
                .collect()
        };
        for path in entries {
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|ext| ext != "rs") || path == root.join("local.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for forbidden in [
                "posix_spawn",
                "process::Command",
                "Command::new",
                "libc::exec",
                "libc::fork",
                "libc::system",
            ] {
                assert!(
                    !text.contains(forbidden),
                    "{} uses {forbidden}",
                    path.display()
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked > 10,
        "only {checked} files checked under {}",
        root.display()
    );
}

/// With `data.allowed_paths` set, a REST submission naming a file outside it is refused before
/// the scheduler opens it, and a node refuses a task whose plan (built by a client library,
/// past any spec check) reads or writes outside it; jobs inside it run.
#[test]
fn paths_outside_data_allowed_paths_are_refused_by_scheduler_and_nodes() {
    let runtime = runtime();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("data");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("in.csv"), "x\n1\n2\n3\n").unwrap();
    std::fs::write(dir.path().join("outside.csv"), "x\n7\n").unwrap();
    let allowed = format!("data.allowed_paths={}", root.display());
    let cluster = cluster(&runtime, 1, &[&allowed]);
    let schedulers = &cluster.schedulers;

    let http = schedulers.http_addr(1).unwrap().to_owned();
    let spec = format!(
        "[source]\nread_csv = [{:?}]\n",
        dir.path().join("outside.csv").to_str().unwrap()
    );
    let refused = post_job(&http, cluster.config.token(), &spec);
    assert!(refused.starts_with("HTTP/1.1 400"), "{refused}");
    assert!(refused.contains("outside data.allowed_paths"), "{refused}");

    runtime.block_on(async {
        let client = Client::connect(&schedulers.addrs(), cluster.config.token())
            .await
            .unwrap();
        let outside = Dataset::read_csv(&[dir.path().join("outside.csv")]).unwrap();
        let handle = client.submit(&outside).await.unwrap();
        assert!(handle.wait().await.is_err());
        let error = handle.error().await.unwrap().unwrap_or_default();
        assert!(error.contains("outside data.allowed_paths"), "{error}");
        let escaping_sink = Dataset::read_csv(&[root.join("in.csv")])
            .unwrap()
            .write_csv(
                root.join("out/../../escaped"),
                floe_client::WriteOptions::default(),
            )
            .unwrap();
        let handle = client.submit(&escaping_sink).await.unwrap();
        assert!(handle.wait().await.is_err());
        assert!(!dir.path().join("escaped").exists());
        let inside = Dataset::read_csv(&[root.join("in.csv")]).unwrap();
        let output = client.submit(&inside).await.unwrap().wait().await.unwrap();
        assert_eq!(output.rows(), 3);
    });
}

/// POSTs a job spec as TOML with the token; the whole raw response.
fn post_job(addr: &str, token: &str, spec: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    let request = format!(
        "POST /api/jobs HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/toml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{spec}",
        spec.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// A peer that passes the handshake with the token and then sends a frame over
/// `net.max_frame` (here 1 MiB) is cut off before the server reads it, at the scheduler and
/// at a node alike; the processes keep serving.
#[test]
fn an_oversize_frame_after_the_handshake_closes_only_that_connection() {
    use floe_core::wire::FramedStream;
    use floe_core::wire::handshake::{Hello, client_handshake};

    let runtime = runtime();
    let cluster = cluster(&runtime, 1, &["net.max_frame=1MiB"]);
    let (schedulers, node) = (&cluster.schedulers, cluster.node(0));

    for addr in [
        schedulers.addr(1).unwrap().to_owned(),
        node.addr().to_owned(),
    ] {
        runtime.block_on(async {
            let socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let timeout = Duration::from_secs(5);
            // This side allows large frames; the server does not.
            let mut stream = FramedStream::new(socket, 64 << 20, timeout, timeout);
            let hello = Hello {
                credential: Credential::Member {
                    secret: cluster.config.credentials.cluster_secret.clone(),
                },
            };
            client_handshake(&mut stream, &hello, timeout)
                .await
                .unwrap();
            // The send itself may fail once the server hangs up mid-frame.
            let _ = stream
                .send_with(|out| {
                    out.resize(8 << 20, 0xab);
                    Ok(())
                })
                .await;
            // The server hangs up: end of stream or a reset, not a reply and not silence.
            let closed = stream.recv(timeout).await;
            assert!(
                matches!(
                    closed,
                    Err(floe_core::WireError::Closed | floe_core::WireError::Io { .. })
                ),
                "{addr} did not hang up on an oversize frame: {closed:?}"
            );
        });
    }
    assert!(is_running(node.pid()), "the node died");
    assert!(schedulers.is_running(1), "the scheduler died");
    runtime.block_on(async {
        let client = Client::connect(&schedulers.addrs(), cluster.config.token())
            .await
            .unwrap();
        check_a_job(&client).await;
    });
}
