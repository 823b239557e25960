//! The client subcommands: `floe status`, `floe nodes`, `floe jobs [--all]`, `floe job ID`,
//! `floe job delete ID`, `floe cancel ID`, `floe up`, plus the progress bars and stats table `floe demo` and
//! `--wait` share.

use std::collections::{BTreeMap, BTreeSet};

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use clap::{Args, Subcommand};
use floe_api::state::utc_time;
use floe_client::local::{LocalPort, LocalPorts};
use floe_client::{Client, JobHandle, JobProgress, JobState, JobStats, LocalCluster};
use floe_client::{
    JobOutput, LocalClusterDir, LocalClusterOptions, Registry, WaitEvent, WaitOptions,
};
use floe_core::plan::UdfCodePolicy;
use floe_core::{Config, JobId};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

/// Where the cluster is.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Every scheduler replica, `host:port,host:port,…`. Default: the configuration's
    /// `client.address` (`FLOE_ADDRESS`). The client token comes from the configuration too:
    /// `FLOE_CLIENT_TOKEN` (or `FLOE_TOKEN`), or `client.token`.
    #[arg(long = "scheduler", value_delimiter = ',')]
    pub schedulers: Vec<String>,
}

impl ClusterArgs {
    /// Connects with the configured token, over TLS when `tls.ca` is set.
    pub async fn connect(&self, config: &Config) -> anyhow::Result<Client> {
        let schedulers = if self.schedulers.is_empty() {
            &config.client.address
        } else {
            &self.schedulers
        };
        anyhow::ensure!(
            !schedulers.is_empty(),
            "where is the cluster? Set FLOE_ADDRESS=host:port,… (client.address) or pass \
             --scheduler host:port,…"
        );
        Ok(Client::connect_with(schedulers, config.client.token.expose(), &config.tls).await?)
    }
}

#[derive(Debug, Args)]
pub struct JobArgs {
    /// The job's id (as `floe jobs` lists it).
    pub job: JobId,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    /// Also list the jobs that left the scheduler's state (deleted, or past
    /// `jobs.keep_finished` / `jobs.keep_for`), from a replica's history.
    #[arg(long)]
    pub all: bool,
    /// How many jobs to list at most, newest first.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Skip this many of the newest jobs first (the next page).
    #[arg(long, default_value_t = 0)]
    pub offset: u32,
    /// Only the jobs whose name (a job file's `name`) contains this text.
    #[arg(long, value_name = "TEXT")]
    pub name: Option<String>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// `floe job ID`, or `floe job delete ID`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct JobCommandArgs {
    /// The job's id (as `floe jobs` lists it).
    #[arg(required = true)]
    pub job: Option<JobId>,
    /// Also print the first N rows of the job's result (held in the cluster).
    #[arg(long, value_name = "N")]
    pub rows: Option<u64>,
    #[command(subcommand)]
    pub action: Option<JobAction>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

#[derive(Debug, Subcommand)]
pub enum JobAction {
    /// Delete an ended job: its result blocks are freed at once and it leaves the job list
    /// (`floe jobs --all` still shows its summary).
    Delete(JobArgs),
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The job-spec file (TOML; see `floe_client::jobspec` and the README).
    pub file: std::path::PathBuf,
    /// Wait for the job, with a progress bar per operator, and print its stats. Waits
    /// through scheduler leader changes and quorum loss, saying so on stderr.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up (exit non-zero) after this long, e.g. `90s`, `500ms`, `10m`,
    /// `2h`. Without it, --wait waits as long as the job runs.
    #[arg(long, requires = "wait", value_parser = parse_timeout)]
    pub timeout: Option<Duration>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// A positive whole number of `ms`, `s`, `m` or `h`.
fn parse_timeout(text: &str) -> anyhow::Result<Duration> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| anyhow::anyhow!("`{text}` has no unit; write e.g. 90s, 500ms, 10m or 2h"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| anyhow::anyhow!("`{text}` does not start with a whole number"))?;
    let duration = match unit {
        "ms" => Duration::from_millis(number),
        "s" => Duration::from_secs(number),
        "m" => Duration::from_secs(number.saturating_mul(60)),
        "h" => Duration::from_secs(number.saturating_mul(3600)),
        other => anyhow::bail!("unknown unit `{other}` in `{text}`; use ms, s, m or h"),
    };
    anyhow::ensure!(!duration.is_zero(), "the timeout must be longer than 0");
    Ok(duration)
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Nodes to start besides the scheduler; they split the host's memory (`memory.total`,
    /// detected unless set) equally between them.
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// Worker processes per node (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub workers: u32,
    /// Run in a new temporary directory, removed on exit. Without it the cluster runs in
    /// `paths.data_dir` and keeps it (the nodes' caches included) for the next `floe up`.
    #[arg(long)]
    pub temp: bool,
    /// Run without TLS. By default every connection uses TLS with a throwaway CA made for
    /// this cluster in its directory.
    #[arg(long)]
    pub plaintext: bool,
}

pub async fn status(config: &Config, cluster: &ClusterArgs) -> anyhow::Result<()> {
    let client = cluster.connect(config).await?;
    let info = client.cluster().await?;
    println!("scheduler replicas:");
    for (addr, replica) in &info.replicas {
        match replica {
            Some(replica) => {
                let role = if replica.leader == Some(replica.id) {
                    "leader"
                } else {
                    "follower"
                };
                println!(
                    "  {addr}  replica {}  {role}  term {}  commit {}",
                    replica.id, replica.term, replica.commit
                );
            }
            None => println!("  {addr}  not answering"),
        }
    }
    let alive = info.nodes.iter().filter(|node| node.alive).count();
    println!("nodes: {alive} alive, {} dead", info.nodes.len() - alive);
    Ok(())
}

pub async fn nodes(config: &Config, cluster: &ClusterArgs) -> anyhow::Result<()> {
    let client = cluster.connect(config).await?;
    println!(
        "{:<6} {:<22} {:<6} {:>5} {:>10}",
        "NODE", "ADDRESS", "STATE", "CPUS", "HEAP"
    );
    for node in client.nodes().await? {
        let state = if node.alive { "alive" } else { "dead" };
        println!(
            "{:<6} {:<22} {:<6} {:>5} {:>10}{}",
            node.id.to_string(),
            node.address,
            state,
            node.cpus,
            human_bytes(node.heap_bytes),
            node.death
                .map(|reason| format!("  ({reason})"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// One line of `floe jobs`.
struct JobLine {
    id: JobId,
    name: Option<String>,
    state: &'static str,
    submitted_at_ms: u64,
    started_at_ms: Option<u64>,
    ended_at_ms: Option<u64>,
    attempts: u32,
    tasks: Option<u64>,
    sink: String,
    note: &'static str,
}

pub async fn jobs(config: &Config, args: &JobsArgs) -> anyhow::Result<()> {
    let client = args.cluster.connect(config).await?;
    let live = client.jobs().await?;
    let mut lines: Vec<JobLine> = live
        .iter()
        .map(|job| JobLine {
            id: job.id,
            name: job.name.clone(),
            state: job.state.name(),
            submitted_at_ms: job.submitted_at_ms,
            started_at_ms: job.started_at_ms,
            ended_at_ms: job.ended_at_ms,
            attempts: job.attempts,
            tasks: job.stats.as_ref().map(JobStats::compute_tasks),
            sink: job
                .sink()
                .map_or_else(|| "-".to_owned(), |dir| dir.display().to_string()),
            note: "",
        })
        .collect();
    if args.all {
        let wanted = args.offset.saturating_add(args.limit);
        for job in client.job_history(wanted).await? {
            // A job removed after the live list was read can show in both.
            if live.iter().any(|live| live.id == job.id) {
                continue;
            }
            lines.push(JobLine {
                id: job.id,
                name: job.name.clone(),
                state: job.status.name(),
                submitted_at_ms: job.submitted_at_ms,
                started_at_ms: job.started_at_ms,
                ended_at_ms: job.ended_at_ms,
                attempts: job.attempts,
                tasks: job.stats.as_ref().map(JobStats::compute_tasks),
                // The history keeps no plan.
                sink: "?".to_owned(),
                note: match job.removal {
                    floe_api::state::Removal::Deleted => "  (deleted)",
                    floe_api::state::Removal::Pruned => "  (history)",
                },
            });
        }
    }
    if let Some(wanted) = &args.name {
        lines.retain(|line| line.name.as_ref().is_some_and(|name| name.contains(wanted)));
    }
    // Newest first: ids are handed out in submission order.
    lines.sort_by_key(|line| std::cmp::Reverse(line.id));
    let now_ms = now_ms();
    println!(
        "{:<6} {:<16} {:<10} {:<23} {:<23} {:>10} {:>8} {:>6}  SINK",
        "JOB", "NAME", "STATE", "SUBMITTED", "ENDED", "DURATION", "ATTEMPTS", "TASKS"
    );
    let offset = usize::try_from(args.offset).unwrap_or(usize::MAX);
    let limit = usize::try_from(args.limit).unwrap_or(usize::MAX);
    for line in lines.iter().skip(offset).take(limit) {
        let duration = line
            .started_at_ms
            .map(|started| line.ended_at_ms.unwrap_or(now_ms).saturating_sub(started));
        println!(
            "{:<6} {:<16} {:<10} {:<23} {:<23} {:>10} {:>8} {:>6}  {}{}",
            line.id.to_string(),
            line.name.as_deref().unwrap_or("-"),
            line.state,
            utc_time(line.submitted_at_ms),
            line.ended_at_ms.map_or_else(|| "-".to_owned(), utc_time),
            duration.map_or_else(|| "-".to_owned(), human_duration),
            line.attempts,
            line.tasks
                .map_or_else(|| "-".to_owned(), |tasks| tasks.to_string()),
            line.sink,
            line.note
        );
    }
    let shown = lines.len().saturating_sub(offset).min(limit);
    if offset.saturating_add(shown) < lines.len() {
        println!(
            "({} more: --offset {})",
            lines.len() - offset - shown,
            offset + shown
        );
    }
    Ok(())
}

/// Milliseconds since the Unix epoch on this machine's clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// `950ms`, `12.3s`, `4m05s`, `2h03m`.
pub(crate) fn human_duration(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

pub async fn delete_job(config: &Config, args: &JobArgs) -> anyhow::Result<()> {
    let client = args.cluster.connect(config).await?;
    client.job(args.job).delete().await?;
    println!("job {}: deleted; its result is being freed", args.job);
    Ok(())
}

pub async fn job(
    config: &Config,
    job: JobId,
    rows: Option<u64>,
    cluster: &ClusterArgs,
) -> anyhow::Result<()> {
    let client = cluster.connect(config).await?;
    let handle = client.job(job);
    let state = handle.state().await?;
    println!("job {job}: {}", state.name());
    let info = client.jobs().await?.into_iter().find(|info| info.id == job);
    if let Some(info) = &info {
        if let Some(name) = &info.name {
            println!("  name:      {name}");
        }
        let at = |ms: Option<u64>| ms.map_or_else(|| "-".to_owned(), utc_time);
        println!("  submitted: {}", utc_time(info.submitted_at_ms));
        println!("  started:   {}", at(info.started_at_ms));
        println!("  ended:     {}", at(info.ended_at_ms));
        if let Some(duration) = info.duration_ms(now_ms()) {
            println!("  duration:  {}", human_duration(duration));
        }
        if let Some(plan) = &info.plan {
            println!("  plan:");
            for line in plan.display_tree().lines() {
                println!("    {line}");
            }
        }
    }
    if let JobState::Failed { message } = &state {
        println!("error: {message}");
        println!(
            "hint: the failing task's node log has the details (`floe nodes` lists the nodes); \
             fix the job file and submit it again"
        );
    }
    let sink = info.as_ref().and_then(|info| info.sink());
    let mut output = None;
    match (&state, sink) {
        (_, Some(directory)) => println!("output: written to {}", directory.display()),
        (JobState::Succeeded, None) => match handle.wait().await {
            Ok(held) => {
                println!(
                    "output: {} rows, {} held in the cluster",
                    held.rows(),
                    human_bytes(held.bytes())
                );
                output = Some(held);
            }
            Err(error) => println!("output: not available ({error})"),
        },
        _ => {}
    }
    if let Some(progress) = handle.progress().await? {
        for operator in &progress.operators {
            let total = operator
                .tasks_total
                .map_or_else(|| "?".to_owned(), |total| total.to_string());
            println!(
                "  {:<16} {}/{} tasks, {} running, {} queued, {} rows",
                operator.name,
                operator.tasks_done,
                total,
                operator.tasks_running,
                operator.tasks_queued,
                operator.rows_done
            );
        }
    }
    if let Some(stats) = handle.stats().await? {
        print_stats(&stats);
    }
    if let Some(output) = output {
        if let Some(rows) = rows {
            print!("{}", format_batches(&output.take(rows).await?)?);
        }
        // Another reader may still want it: it stays until jobs.result_ttl or a delete.
        output.keep();
    } else if rows.is_some() {
        println!("(no rows held: the job has no result in the cluster)");
    }
    Ok(())
}

/// Validates the job file, submits it, and with `--wait` follows it to the end.
pub async fn submit(config: &Config, args: &SubmitArgs, udfs: Arc<Registry>) -> anyhow::Result<()> {
    let name = args.file.display().to_string();
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read the job file {name}"))?;
    let job_file = floe_client::jobspec::parse_job_file(&name, &text, udfs)?;
    // Refused here rather than on every node: the nodes check the same rule (and their roots).
    let code = UdfCodePolicy::for_node(&config.node);
    for udf in job_file.dataset.plan().process_udfs() {
        code.check_command_line(udf)
            .with_context(|| format!("{name}: {}", udf.label()))?;
    }
    let client = args.cluster.connect(config).await?;
    let job = match &job_file.name {
        Some(job_name) => {
            client
                .submit_named(job_name, &job_file.dataset, job_file.options)
                .await?
        }
        None => {
            client
                .submit_with(&job_file.dataset, job_file.options)
                .await?
        }
    };
    emit(&format!("job {} submitted\n", job.id()))?;
    if args.wait {
        let options = WaitOptions {
            timeout: args.timeout,
        };
        let output = wait_with_bars(&job, options).await?;
        let mut text = format!("job {} succeeded: {} rows\n", job.id(), output.rows());
        text.push_str(&format_stats(&output.stats));
        text.push_str(&format_batches(&output.take(10).await?)?);
        // Held for a later reader (another client, the dashboard) until jobs.result_ttl or
        // `floe job delete`; this process ends before a release on drop could be sent.
        output.keep();
        emit(&text)?;
    }
    Ok(())
}

/// Batches as an aligned text table.
pub fn format_batches(batches: &[RecordBatch]) -> anyhow::Result<String> {
    let Some(first) = batches.first() else {
        return Ok("(no rows)\n".to_owned());
    };
    let schema = first.schema();
    let mut rows: Vec<Vec<String>> =
        vec![schema.fields().iter().map(|f| f.name().clone()).collect()];
    let options = FormatOptions::default();
    for batch in batches {
        let formatters = batch
            .columns()
            .iter()
            .map(|column| ArrayFormatter::try_new(column.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()?;
        for row in 0..batch.num_rows() {
            rows.push(
                formatters
                    .iter()
                    .map(|f| f.value(row).to_string())
                    .collect(),
            );
        }
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|column| rows.iter().map(|row| row[column].len()).max().unwrap_or(0))
        .collect();
    let mut text = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:>width$}"))
            .collect();
        writeln!(text, "  {}", cells.join("  "))?;
    }
    Ok(text)
}

pub async fn cancel(config: &Config, args: &JobArgs) -> anyhow::Result<()> {
    let client = args.cluster.connect(config).await?;
    client.job(args.job).cancel().await?;
    println!("job {}: cancel requested", args.job);
    Ok(())
}

/// Runs a local cluster in the foreground until Ctrl-C or SIGTERM.
/// Its secrets and an admin client token are generated for it; the token is written to a file
/// only this user can read, and only the file's path is printed.
pub async fn up(config: &Config, args: &UpArgs) -> anyhow::Result<()> {
    // Installed before the cluster starts, so a stop during start-up still tears it down.
    let mut stop = floe_node::Termination::install()?;
    let host_memory = floe_objectstore::MemoryPools::host_total(&config.memory)?;
    let mut node_settings = process_udf_settings(config);
    node_settings.push(node_memory_setting(host_memory, args.nodes));
    let dir = if args.temp {
        LocalClusterDir::Temporary
    } else {
        LocalClusterDir::Kept(config.paths.data_dir.clone())
    };
    let options = LocalClusterOptions {
        nodes: args.nodes,
        binary: std::env::current_exe().context("cannot find the floe binary")?,
        workers_per_node: args.workers,
        node_settings,
        ports: local_ports(config),
        tls: !args.plaintext,
    };
    let cluster = LocalCluster::start_in(options, &dir).await?;
    print_local_cluster(&cluster);
    println!("press Ctrl-C to stop it");
    let signal = stop.recv().await;
    println!("stopping ({signal})");
    drop(cluster);
    Ok(())
}

/// The ports `floe up` gives its processes: a port set away from its default is used as
/// given (node `i` on `node.rpc_port + i`); an unset one is picked free, since the defaults
/// would collide between the nodes of one host.
fn local_ports(config: &Config) -> LocalPorts {
    let defaults = Config::default();
    let port = |setting: &'static str, port: u16, default: u16| {
        if port == default {
            LocalPort::Free
        } else {
            LocalPort::Fixed { setting, port }
        }
    };
    LocalPorts {
        scheduler_rpc: port(
            "scheduler.rpc_port",
            config.scheduler.rpc_port,
            defaults.scheduler.rpc_port,
        ),
        scheduler_http: port(
            "scheduler.http_port",
            config.scheduler.http_port,
            defaults.scheduler.http_port,
        ),
        node_rpc: port(
            "node.rpc_port",
            config.node.rpc_port,
            defaults.node.rpc_port,
        ),
    }
}

/// The nodes `floe up` starts share one host: each gets an equal part of its memory
/// (`memory.total`, detected unless set), so their object stores and heaps together fit it.
fn node_memory_setting(host_memory: u64, nodes: usize) -> String {
    let nodes = u64::try_from(nodes.max(1)).unwrap_or(u64::MAX);
    format!("memory.total={}", host_memory / nodes)
}

/// The nodes `floe up` starts take only the settings given to them: these pass on what
/// process UDFs may run (`floe --set node.udf_roots=/srv/udfs up`).
fn process_udf_settings(config: &Config) -> Vec<String> {
    let roots: Vec<String> = config
        .node
        .udf_roots
        .iter()
        .map(|root| root.display().to_string())
        .collect();
    vec![
        format!("node.udf_commands={}", config.node.udf_commands.join(",")),
        format!("node.udf_roots={}", roots.join(",")),
        format!("node.udf_allow_inline={}", config.node.udf_allow_inline),
    ]
}

pub fn print_local_cluster(cluster: &LocalCluster) {
    let schedulers = cluster.addresses().join(",");
    println!("local cluster up:");
    println!("  schedulers: {schedulers}");
    println!("  nodes:      {}", cluster.node_addresses().join(", "));
    println!("  files:      {}", cluster.dir().display());
    println!("  dashboard:  {}", cluster.dashboard_url());
    let token_file = cluster.token_file();
    println!(
        "  token:      {} (an admin client token, mode 0600)",
        token_file.display()
    );
    let ca = match cluster.ca_file() {
        Some(ca) => {
            println!(
                "  ca:         {} (TLS: clients verify with it)",
                ca.display()
            );
            format!("FLOE_TLS_CA={} ", ca.display())
        }
        None => String::new(),
    };
    println!(
        "  use it:     export {ca}FLOE_ADDRESS={schedulers} FLOE_TOKEN=$(cat {}); floe jobs",
        token_file.display()
    );
}

/// Waits for `job`, drawing one progress bar per operator, through leader changes and
/// quorum loss (said on stderr), until `options.timeout` if any.
pub async fn wait_with_bars(job: &JobHandle, options: WaitOptions) -> anyhow::Result<JobOutput> {
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} tasks {msg}")
        .context("progress bar style")?
        .progress_chars("=> ");
    let mut by_operator: BTreeMap<usize, ProgressBar> = BTreeMap::new();
    let mut draw = |progress: &JobProgress| {
        for (index, operator) in progress.operators.iter().enumerate() {
            let Some(shown) = BarState::of(operator) else {
                continue;
            };
            shown.show(bar_at(
                &bars,
                &style,
                &mut by_operator,
                index,
                &operator.name,
            ));
        }
    };
    let id = job.id();
    let on_event = |event: WaitEvent<'_>| {
        match event {
            WaitEvent::Progress(progress) => draw(progress),
            WaitEvent::SchedulerUnavailable(error) => {
                bars.suspend(|| {
                    eprintln!("no scheduler leader; still waiting for job {id}… ({error})");
                });
            }
        }
        Ok(())
    };
    let output = job.wait_with(options, on_event).await;
    if let Ok(output) = &output {
        // The last report can predate the last tasks: the bars end on the final stats, so
        // they show what the stats table below them says.
        let started: BTreeSet<usize> = by_operator.keys().copied().collect();
        for (index, (name, shown)) in final_bars(&started, &output.stats) {
            shown.show(bar_at(&bars, &style, &mut by_operator, index, &name));
        }
    }
    for bar in by_operator.values() {
        bar.finish();
    }
    Ok(output?)
}

/// Operator `index`'s bar, added in plan order (also after the bars of later operators) the
/// first time it is asked for.
fn bar_at<'a>(
    bars: &MultiProgress,
    style: &ProgressStyle,
    by_operator: &'a mut BTreeMap<usize, ProgressBar>,
    index: usize,
    name: &str,
) -> &'a ProgressBar {
    let position = by_operator.range(..index).count();
    by_operator.entry(index).or_insert_with(|| {
        let bar = bars.insert(position, ProgressBar::new(0));
        bar.set_style(style.clone());
        bar.set_prefix(name.to_owned());
        bar
    })
}

/// The bars a finished job ends on, by operator index: each operator that had a bar or did
/// work, with its totals from `stats` (operators are in the same order in progress reports and
/// stats; names can repeat, as the two reads of a join do).
fn final_bars(started: &BTreeSet<usize>, stats: &JobStats) -> BTreeMap<usize, (String, BarState)> {
    stats
        .operators
        .iter()
        .enumerate()
        .filter(|(index, operator)| {
            started.contains(index) || operator.tasks > 0 || operator.rows > 0
        })
        .map(|(index, operator)| {
            let shown = BarState {
                length: operator.tasks,
                done: operator.tasks,
                rows: operator.rows,
            };
            (index, (operator.name.clone(), shown))
        })
        .collect()
}

/// What one operator's progress bar shows.
#[derive(Debug, PartialEq, Eq)]
struct BarState {
    length: u64,
    done: u64,
    rows: u64,
}

impl BarState {
    /// `None` until the operator has started: a bar for work not begun (`0/0`, drawn full)
    /// would claim progress that was not made.
    fn of(operator: &floe_core::job::OperatorProgress) -> Option<Self> {
        let started = operator.tasks_done + operator.tasks_running > 0 || operator.rows_done > 0;
        if !started {
            return None;
        }
        let known = operator.tasks_done + operator.tasks_running + operator.tasks_queued;
        let length = operator
            .tasks_total
            .unwrap_or(known)
            .max(operator.tasks_done);
        Some(Self {
            length,
            done: operator.tasks_done,
            rows: operator.rows_done,
        })
    }

    fn show(&self, bar: &ProgressBar) {
        bar.set_length(self.length);
        bar.set_position(self.done);
        bar.set_message(format!("{} rows", self.rows));
    }
}

/// The per-operator stats table.
pub fn print_stats(stats: &JobStats) {
    print!("{}", format_stats(stats));
}

/// The per-operator stats table as text.
pub fn format_stats(stats: &JobStats) -> String {
    let mut text = format!(
        "driver attempt {}, {} ms, {} spilled\n",
        stats.attempt,
        stats.wall_ms,
        human_bytes(stats.spilled_bytes)
    );
    // Fused names (`read→filter→with_column`) can be long: the column fits the longest.
    let width = stats
        .operators
        .iter()
        .map(|operator| operator.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(16);
    let _ = writeln!(
        text,
        "  {:<width$} {:>8} {:>6} {:>6} {:>10} {:>10} {:>6} {:>6} {:>8}",
        "OPERATOR", "TASKS", "RETRY", "REBUILT", "ROWS", "BYTES", "HITS", "MISSES", "WALL_MS"
    );
    for operator in &stats.operators {
        let _ = writeln!(
            text,
            "  {:<width$} {:>8} {:>6} {:>6} {:>10} {:>10} {:>6} {:>6} {:>8}",
            operator.name,
            operator.tasks,
            operator.retries,
            operator.rebuilt,
            operator.rows,
            human_bytes(operator.bytes),
            operator.cache_hits,
            operator.cache_misses,
            operator.wall_ms
        );
        if let Some(hot_key) = &operator.hot_key {
            let _ = writeln!(text, "  {:<width$} skew: {hot_key}", "");
        }
    }
    text
}

/// Stdout's reader went away: the command's output was cut short on purpose (`| head`),
/// which is a success.
#[derive(Debug)]
pub struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes `text` to stdout and flushes it, returning [`StdoutClosed`] rather than panicking
/// as `print!` does: `floe submit --wait | head` ends quietly when `head` exits, while the
/// job it submitted runs on.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        written => Ok(written?),
    }
}

/// Bytes in the largest binary unit that keeps the number at least 1.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_splits_the_host_memory_between_its_nodes() {
        let config = floe_core::config::ConfigLoader::new()
            .set(&node_memory_setting(24 << 30, 2))
            .unwrap()
            .load()
            .unwrap();
        let share = floe_objectstore::MemoryPools::host_total(&config.memory).unwrap();
        assert_eq!(share, 12 << 30);
        assert_eq!(node_memory_setting(900, 1), "memory.total=900");
        assert_eq!(node_memory_setting(900, 0), "memory.total=900");
    }

    #[test]
    fn an_operator_gets_a_bar_once_it_starts() {
        let mut operator = floe_core::job::OperatorProgress {
            name: "aggregate".into(),
            tasks_queued: 4,
            ..Default::default()
        };
        assert_eq!(BarState::of(&operator), None, "queued only: not started");
        operator.tasks_running = 1;
        operator.tasks_queued = 3;
        assert_eq!(
            BarState::of(&operator),
            Some(BarState {
                length: 4,
                done: 0,
                rows: 0
            })
        );
        operator.tasks_total = Some(8);
        operator.tasks_done = 2;
        operator.rows_done = 500;
        assert_eq!(
            BarState::of(&operator),
            Some(BarState {
                length: 8,
                done: 2,
                rows: 500
            })
        );
    }

    #[test]
    fn the_bars_end_on_each_operators_own_stats() {
        let operator = |name: &str, tasks: u64, rows: u64| floe_core::job::OperatorStats {
            name: name.to_owned(),
            tasks,
            rows,
            ..Default::default()
        };
        // A join reads twice: two operators with one name, each with its own totals.
        let stats = JobStats {
            operators: vec![
                operator("read→filter", 4, 400),
                operator("read→filter", 2, 20),
                operator("join", 0, 0),
                operator("limit", 0, 0),
            ],
            ..Default::default()
        };
        let started = BTreeSet::from([0, 2]);
        let bars = final_bars(&started, &stats);
        let shown: Vec<(usize, u64, u64)> = bars
            .iter()
            .map(|(index, (_, bar))| (*index, bar.done, bar.rows))
            .collect();
        // The second read finished between two reports: it gets its bar at the end. The
        // limit never ran and gets none.
        assert_eq!(shown, [(0, 4, 400), (1, 2, 20), (2, 0, 0)]);
        for (index, (name, bar)) in &bars {
            let stats = &stats.operators[*index];
            assert_eq!(name, &stats.name);
            assert_eq!(
                (bar.length, bar.done, bar.rows),
                (stats.tasks, stats.tasks, stats.rows)
            );
        }
    }

    #[test]
    fn up_uses_the_ports_that_are_set() {
        assert_eq!(local_ports(&Config::default()), LocalPorts::default());
        let config = floe_core::config::ConfigLoader::new()
            .set("scheduler.http_port=9999")
            .unwrap()
            .load()
            .unwrap();
        assert_eq!(
            local_ports(&config),
            LocalPorts {
                scheduler_http: LocalPort::Fixed {
                    setting: "scheduler.http_port",
                    port: 9999
                },
                ..LocalPorts::default()
            }
        );
    }
}
