//! `limiter daemon`: owns the program, its pinned maps and its pinned XDP
//! links on every configured interface. Everything that matters is pinned,
//! so when the daemon stops (even `kill -9`) the program keeps enforcing
//! with the same buckets, and the next daemon adopts it all. It applies rule
//! files atomically (control socket, SIGHUP, optional file watch), serves
//! the control socket and the metrics endpoint.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::{Notify, mpsc},
};

use crate::{
    control::{
        self, Request, Response,
        protocol::{Detached, Status},
    },
    engine::{Change, Engine},
    fleet::{Enforcer, Fleet, FleetConfig, Grant, RuleCounts, RuleRef, node::ShareStatus},
    kernel::{
        self, Attachment, Mode, capabilities,
        links::LINKS_DIR,
        pins::{self, PinLock},
        require_root,
    },
    listen::{self, AcceptErrors, Limits, Slots},
    render::openmetrics::{self, Format},
    rules::{self, RuleSet, watch::FileWatch},
    trace::{TraceFilter, TraceLine},
};

/// The daemon's own configuration file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// The rule file (relative paths are relative to this file's folder).
    pub rules: PathBuf,
    pub interfaces: Vec<InterfaceConfig>,
    #[serde(default = "default_pin_dir")]
    pub pin_dir: PathBuf,
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// `host:port` of the Prometheus endpoint, or `off`. Default: loopback only.
    #[serde(default = "default_metrics")]
    pub metrics: String,
    /// Re-apply the rule file when it changes on disk.
    #[serde(default)]
    pub watch: bool,
    /// The metrics endpoint's connection cap and header deadline.
    #[serde(default)]
    pub metrics_listener: Limits,
    /// The control socket's connection cap, and how long a client may take
    /// to send a whole request (each connection may buffer a 4 MiB rule
    /// file, hence a lower cap).
    #[serde(default = "default_control_listener")]
    pub control_listener: Limits,
    /// The store that fleet-wide rules (`scope: fleet`) lease their shares
    /// from; without it they enforce their reserve.
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    pub name: String,
    #[serde(default)]
    pub mode: Mode,
}

fn default_pin_dir() -> PathBuf {
    pins::DEFAULT_PIN_DIR.into()
}

fn default_socket() -> PathBuf {
    control::DEFAULT_SOCKET.into()
}

fn default_metrics() -> String {
    "127.0.0.1:9464".into()
}

fn default_control_listener() -> Limits {
    Limits {
        max_connections: 16,
        ..Limits::default()
    }
}

impl DaemonConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let mut config: Self = crate::yaml::load(path)?;
        if config.rules.is_relative() {
            config.rules = path.parent().unwrap_or(Path::new(".")).join(&config.rules);
        }
        if let Some(fleet) = &config.fleet {
            fleet
                .validate("fleet")
                .with_context(|| path.display().to_string())?;
        }
        if config.interfaces.is_empty() {
            anyhow::bail!(
                "{}: interfaces: name at least one interface",
                path.display()
            );
        }
        Ok(config)
    }

    fn metrics_addr(&self) -> Result<Option<SocketAddr>> {
        if self.metrics == "off" {
            return Ok(None);
        }
        let addr: SocketAddr = self.metrics.parse().with_context(|| {
            format!(
                "metrics: {} is not host:port or `off`",
                crate::yaml::quoted(&self.metrics)
            )
        })?;
        if !addr.ip().is_loopback() {
            tracing::warn!(
                "metrics listen on {addr}, which is not a loopback address (as configured)"
            );
        }
        Ok(Some(addr))
    }
}

/// State shared by the daemon's tasks.
struct Shared {
    /// Held only by blocking tasks; see [`Shared::engine`].
    engine: Mutex<Engine>,
    config: DaemonConfig,
    attachments: Vec<Attachment>,
    generation: AtomicU64,
    /// Rule files re-read (SIGHUP, `--watch`) and refused.
    rule_file_rejections: AtomicU64,
    tracked_keys: AtomicU64,
    /// The pins went missing and are not back yet.
    pins_missing: std::sync::atomic::AtomicBool,
    shutdown: Notify,
    /// The fleet rules' loops, once the runtime runs.
    fleet: Mutex<Option<Fleet>>,
}

impl Shared {
    /// The engine, also after a task panicked while holding it: the engine
    /// writes a rule set into the inactive generation and flips to it last,
    /// so an interrupted change leaves the one in force whole, and a dead
    /// control plane would be worse than going on.
    fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|poisoned| {
            tracing::error!(
                "a task panicked while changing the rules; the rules in force are unchanged"
            );
            self.engine.clear_poison();
            poisoned.into_inner()
        })
    }
}

pub fn run(config_path: &Path) -> Result<()> {
    require_root()?;
    let config = DaemonConfig::load(config_path)?;
    let metrics_addr = config.metrics_addr()?;
    let rules = RuleSet::load(&config.rules)?;
    pins::ensure_bpffs()?;
    let _lock = PinLock::acquire(&config.pin_dir)?;
    let adopting = config.pin_dir.join(LINKS_DIR).exists();
    let mut engine = Engine::open(&config.pin_dir, rules.max_keys)?;
    let change = engine.apply(rules)?;
    change.log(&config.rules.display().to_string());
    let mut attachments = Vec::new();
    for iface in &config.interfaces {
        let attachment = engine.attach(&iface.name, iface.mode, true)?;
        if attachment.adopted {
            tracing::info!(event = "adopted_link", iface = %iface.name, "adopted the pinned link; program replaced atomically, buckets kept");
        } else {
            tracing::info!(event = "attached", iface = %iface.name, mode = ?attachment.mode, "attached");
        }
        attachments.push(attachment);
    }
    if adopting {
        tracing::info!(
            event = "adopted_state",
            pin_dir = %config.pin_dir.display(),
            "adopted the state pinned at {}",
            config.pin_dir.display()
        );
        // The program replaced may have been a build that kept no filter:
        // keys it stored until the swap have no bit. Once packets still in
        // it are done, rebuild.
        std::thread::sleep(crate::clock::GRACE);
        engine.datapath_mut().rebuild_key_filter()?;
    }
    let metrics = metrics_addr
        .map(|addr| {
            let listener = std::net::TcpListener::bind(addr)
                .with_context(|| format!("metrics listener on {addr}"))?;
            listener.set_nonblocking(true)?;
            tracing::info!("metrics on http://{addr}/metrics");
            anyhow::Ok(listener)
        })
        .transpose()?;
    // Bound last: once the control socket takes connections, everything
    // else listens too (scripts and tests wait for it).
    let control = control::server::bind(&config.socket)?;
    tracing::info!("control socket {} (root only)", config.socket.display());
    // Everything that needed more than the program's own capabilities is
    // done: loaded, attached, bound. Capabilities belong to threads, and a
    // thread starts with its creator's: dropped here, before the runtime
    // starts any, they are dropped for every thread the daemon will have.
    let kept = capabilities::keep_only_needed().context("dropping capabilities")?;
    let mut kept: Vec<String> = kept.iter().map(ToString::to_string).collect();
    kept.sort();
    tracing::info!("running with {} only", kept.join(", "));
    // A thread of its own, started now: it gets what was kept, no more.
    engine.datapath_mut().log_reports();
    let shared = Arc::new(Shared {
        engine: Mutex::new(engine),
        config,
        attachments,
        generation: AtomicU64::new(1),
        rule_file_rejections: AtomicU64::new(0),
        tracked_keys: AtomicU64::new(0),
        pins_missing: Default::default(),
        shutdown: Notify::new(),
        fleet: Mutex::new(None),
    });
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(serve(shared, control, metrics))
}

async fn serve(
    shared: Arc<Shared>,
    control: std::os::unix::net::UnixListener,
    metrics: Option<std::net::TcpListener>,
) -> Result<()> {
    let socket = &shared.config.socket;
    let listener = tokio::net::UnixListener::from_std(control)?;
    if let Some(metrics) = metrics {
        let listener = tokio::net::TcpListener::from_std(metrics)?;
        let app = axum::Router::new()
            .route("/metrics", axum::routing::get(scrape))
            .with_state(Arc::clone(&shared));
        tokio::spawn(listen::serve_app(
            listener,
            shared.config.metrics_listener,
            "metrics",
            app,
        ));
    }
    tokio::spawn(housekeeping(Arc::clone(&shared)));
    let fleet = Fleet::new(
        shared.config.fleet.clone(),
        Arc::new(KernelShares(Arc::downgrade(&shared))),
    );
    *shared.fleet.lock().expect("fleet lock") = Some(fleet);
    sync_fleet(&shared, &shared.engine().fleet_rules());
    let control = shared.config.control_listener;
    // A unix socket: root's, one kind of client; no per-source share.
    let slots = Slots::new(control.max_connections, control.max_connections);
    let mut accept_errors = AcceptErrors::new("control socket");
    let mut hangup = signal(SignalKind::hangup())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let Some(slot) = slots.take(None) else {
                        tokio::spawn(control::server::refuse(stream, control.max_connections));
                        continue;
                    };
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        let _slot = slot;
                        control::server::serve_connection(
                            stream,
                            control.header_timeout,
                            |request| {
                                let shared = Arc::clone(&shared);
                                async move { handle(&shared, request).await.unwrap_or_else(Response::error) }
                            },
                            |filter| start_trace(&shared, filter),
                        )
                        .await;
                    });
                }
                Err(e) => accept_errors.back_off(&e).await,
            },
            _ = hangup.recv() => {
                tracing::info!("SIGHUP: re-applying {}", shared.config.rules.display());
                reload_file(&shared).await;
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
            _ = shared.shutdown.notified() => {
                let _ = std::fs::remove_file(socket);
                return Ok(());
            }
        }
    }
    let _ = std::fs::remove_file(socket);
    tracing::info!(
        "exiting; the program stays attached and keeps enforcing (`limiter detach` removes it)"
    );
    Ok(())
}

/// Logs each escalation as an `escalated` event.
pub fn log_escalations(escalated: &[crate::engine::escalate::Escalated]) {
    for e in escalated {
        let for_secs = e.block.as_secs_f64();
        if e.enforced && e.hold.is_some() {
            tracing::warn!(event = "escalated", prefix = %e.prefix, rule = %e.rule, for_secs, enforced = true, scope = "key",
                "{} stayed over rule {:?}'s limit: held by the rule for {} (its other traffic passes)", e.prefix, e.rule, humantime::format_duration(e.block));
        } else if e.enforced {
            tracing::warn!(event = "escalated", prefix = %e.prefix, rule = %e.rule, for_secs, enforced = true,
                "{} stayed over rule {:?}'s limit: blocked for {}", e.prefix, e.rule, humantime::format_duration(e.block));
        } else {
            tracing::warn!(event = "escalated", prefix = %e.prefix, rule = %e.rule, for_secs, enforced = false,
                "{} stayed over rule {:?}'s limit: would be blocked for {} (dry run)", e.prefix, e.rule, humantime::format_duration(e.block));
        }
    }
}

/// Traces the kernel's decisions for a client: a thread follows the ring
/// buffer and sends each line, and also logs it (`limiter::trace` target,
/// debug level), until the client hangs up.
fn start_trace(shared: &Arc<Shared>, filter: TraceFilter) -> Result<mpsc::Receiver<TraceLine>> {
    let mut tracer = kernel::trace::KernelTracer::start(&shared.config.pin_dir, &filter)?;
    let (send, lines) = mpsc::channel(1024);
    tracing::info!(event = "trace_started", filter = ?filter, "tracing for a client");
    std::thread::spawn(move || {
        while !send.is_closed() {
            if let Err(e) = tracer.wait(Duration::from_millis(100)) {
                tracing::warn!(event = "error", error = %e, "tracing: {e:#}");
                break;
            }
            while let Some(line) = tracer.next_line() {
                tracing::debug!(target: "limiter::trace", "{}", line.text());
                if send.blocking_send(line).is_err() {
                    break;
                }
            }
        }
        let [traced, lost] = tracer.counts().unwrap_or_default();
        tracing::info!(
            event = "trace_stopped",
            traced,
            lost,
            "the client stopped tracing"
        );
    });
    Ok(lines)
}

async fn reload_file(shared: &Arc<Shared>) {
    let path = shared.config.rules.clone();
    let origin = path.display().to_string();
    let rejected = match tokio::fs::read_to_string(&path).await {
        Ok(text) => apply(shared, text, origin).await.err(),
        Err(e) => Some(anyhow::Error::new(e).context(format!("{}: cannot read", path.display()))),
    };
    if let Some(e) = rejected {
        shared.rule_file_rejections.fetch_add(1, Ordering::Relaxed);
        tracing::error!(event = "rules_rejected", origin = %path.display(), error = %format!("{e:#}"), "{e:#}; nothing changed");
    }
}

/// Validates and applies rule-file text; an invalid file changes nothing.
async fn apply(shared: &Arc<Shared>, text: String, origin: String) -> Result<Change> {
    let shared = Arc::clone(shared);
    tokio::task::spawn_blocking(move || {
        let rules = RuleSet::parse(&text, Path::new(&origin))?;
        let (change, fleet_rules) = {
            let mut engine = shared.engine();
            (engine.apply(rules)?, engine.fleet_rules())
        };
        shared.generation.fetch_add(1, Ordering::Relaxed);
        change.log(&origin);
        sync_fleet(&shared, &fleet_rules);
        Ok(change)
    })
    .await?
}

/// Runs the fleet loops of exactly `rules` (those just applied).
fn sync_fleet(shared: &Shared, rules: &[rules::Rule]) {
    if let Some(fleet) = shared.fleet.lock().expect("fleet lock").as_mut() {
        fleet.sync(rules);
    }
}

fn fleet_status(shared: &Shared) -> Vec<ShareStatus> {
    shared
        .fleet
        .lock()
        .expect("fleet lock")
        .as_ref()
        .map(|f| {
            f.status()
                .lock()
                .expect("fleet status")
                .values()
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// The kernel, as the fleet loops see it: they outlive no daemon, hence
/// the weak reference (the daemon holds the loops).
struct KernelShares(std::sync::Weak<Shared>);

impl Enforcer for KernelShares {
    fn counts(&self, rule: &RuleRef) -> Result<RuleCounts> {
        let shared = self.0.upgrade().context("the daemon is stopping")?;
        shared.engine().fleet_counts(rule)
    }

    fn enforce(&self, rule: &RuleRef, grant: Grant) -> Result<()> {
        let shared = self.0.upgrade().context("the daemon is stopping")?;
        shared.engine().set_fleet_share(rule, grant)
    }
}

/// Expired blocks are removed, tracked keys counted, and the rule file
/// watched (if configured).
async fn housekeeping(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut rule_file = FileWatch::new(&shared.config.rules);
    let mut ticks = 0u64;
    loop {
        tick.tick().await;
        ticks += 1;
        let work = Arc::clone(&shared);
        let _ = tokio::task::spawn_blocking(move || {
            let mut engine = work.engine();
            watch_pins(&work, &mut engine);
            if let Err(e) = engine.remove_expired_blocks() {
                tracing::warn!(event = "error", error = %format!("{e:#}"), "removing expired blocks: {e:#}");
            }
            if let Err(e) = engine.refresh_clock() {
                tracing::warn!(event = "error", error = %format!("{e:#}"), "refreshing the clock offset: {e:#}");
            }
            match engine.escalate() {
                Ok(escalated) => log_escalations(&escalated),
                Err(e) => {
                    tracing::warn!(event = "error", error = %format!("{e:#}"), "escalating: {e:#}")
                }
            }
            // Counting a million keys scans their tags: every 5 s is enough.
            if ticks % 5 == 1 {
                let n = engine.datapath().maps().keys.count();
                work.tracked_keys.store(n as u64, Ordering::Relaxed);
                if let Err(e) = engine.datapath_mut().refresh_key_filter(n) {
                    tracing::warn!(event = "error", error = %format!("{e:#}"), "rebuilding the key table's filter: {e:#}");
                }
                if let Ok(true) = kernel::trace::stop_abandoned(&work.config.pin_dir) {
                    tracing::info!(event = "trace_stopped", "stopped a trace whose tracer died");
                }
            }
        })
        .await;
        if shared.config.watch && rule_file.changed() {
            tracing::info!(
                "{} changed on disk: re-applying",
                shared.config.rules.display()
            );
            reload_file(&shared).await;
        }
    }
}

/// Reports pins that went missing (bpffs unmounted, the directory
/// deleted) once, and writes them again once there is a bpffs to write
/// them in. The program enforces throughout: the daemon holds the maps and
/// links itself.
fn watch_pins(shared: &Shared, engine: &mut Engine) {
    let datapath = engine.datapath_mut();
    if datapath.pins_intact() {
        shared.pins_missing.store(false, Ordering::Relaxed);
        return;
    }
    if !shared.pins_missing.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "the pins under {} are gone (bpffs unmounted?); the program keeps enforcing, \
             held by this daemon; they are written again when a bpffs is mounted there",
            shared.config.pin_dir.display()
        );
    }
    match datapath.repin() {
        Ok(0) => {}
        Ok(n) => {
            shared.pins_missing.store(false, Ordering::Relaxed);
            tracing::info!(
                "pinned {n} maps and links again under {}",
                shared.config.pin_dir.display()
            );
        }
        // Once a second until it works: at debug level after the report.
        Err(e) => tracing::debug!("pinning again: {e:#}"),
    }
}

async fn scrape(
    axum::extract::State(shared): axum::extract::State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
) -> impl axum::response::IntoResponse {
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    let result = tokio::task::spawn_blocking(move || {
        let engine = shared.engine();
        let snapshot = engine.snapshot()?;
        let blocks = engine.blocks()?.len() as u64;
        anyhow::Ok(format.encode(openmetrics::render(
            &snapshot,
            openmetrics::DaemonGauges {
                ruleset_generation: shared.generation.load(Ordering::Relaxed),
                tracked_keys: shared.tracked_keys.load(Ordering::Relaxed),
                blocks,
                pins_missing: shared.pins_missing.load(Ordering::Relaxed),
                fleet: fleet_status(&shared),
                escalations: engine.escalations(),
                escalations_left_out: engine.escalations_left_out(),
                rule_file_rejections: shared.rule_file_rejections.load(Ordering::Relaxed),
            },
        )))
    })
    .await;
    match result {
        Ok(Ok(body)) => (
            axum::http::StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, format.content_type())],
            body,
        ),
        Ok(Err(e)) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            [(axum::http::header::CONTENT_TYPE, "text/plain")],
            format!("{e:#}\n"),
        ),
        Err(e) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            [(axum::http::header::CONTENT_TYPE, "text/plain")],
            format!("{e}\n"),
        ),
    }
}

async fn handle(shared: &Arc<Shared>, request: Request) -> Result<Response> {
    Ok(match request {
        Request::Status => Response::ok(Status {
            pin_dir: shared.config.pin_dir.clone(),
            rules_file: shared.config.rules.clone(),
            interfaces: shared.attachments.clone(),
            ruleset_generation: shared.generation.load(Ordering::Relaxed),
        }),
        Request::Stats => Response::ok(blocking(shared, |engine| engine.snapshot()).await?),
        Request::RulesApply { text, origin } => Response::ok(apply(shared, text, origin).await?),
        Request::RulesShow => {
            let mut view = blocking(shared, |engine| engine.rules_view()).await?;
            view.fleet = fleet_status(shared);
            Response::ok(view)
        }
        Request::Block { prefix, for_secs } => {
            let net = rules::parse_net(&prefix).map_err(anyhow::Error::msg)?;
            let duration = for_secs
                .map(|s| {
                    Duration::try_from_secs_f64(s).context("for_secs must be a positive number")
                })
                .transpose()?;
            blocking(shared, move |engine| engine.block(net, duration)).await?;
            tracing::info!(
                event = "blocked",
                prefix = %net,
                for_secs = duration.map(|d| d.as_secs_f64()),
                "blocked {net} for {}",
                duration.map_or("ever".into(), |d| humantime::format_duration(d).to_string())
            );
            Response::ok(())
        }
        Request::Unblock { prefix } => {
            let net = rules::parse_net(&prefix).map_err(anyhow::Error::msg)?;
            if !blocking(shared, move |engine| engine.unblock(net)).await? {
                anyhow::bail!("{net} is not blocked");
            }
            tracing::info!(event = "unblocked", prefix = %net, "unblocked {net}");
            Response::ok(())
        }
        Request::Shadow { rule, on } => {
            let what = rule.clone().unwrap_or_else(|| "every rule".into());
            blocking(shared, move |engine| engine.set_shadow(rule.as_deref(), on)).await?;
            tracing::info!("dry run {} for {what}", if on { "on" } else { "off" });
            Response::ok(())
        }
        Request::Detach => {
            // Under the engine's lock, links released first: the pins
            // watcher must not pin again what the detach removes.
            let pin_dir = shared.config.pin_dir.clone();
            let detached = blocking(shared, move |engine| {
                engine.datapath_mut().release_links();
                Ok(kernel::detach_all(&pin_dir)?)
            })
            .await?;
            tracing::info!(
                "detached from {detached:?} and removed {}",
                shared.config.pin_dir.display()
            );
            shared.shutdown.notify_one();
            Response::ok(Detached { detached })
        }
        // Streamed by the connection (`start_trace`), never handled here.
        Request::Trace { .. } => Response::error("a trace is streamed, not answered once"),
    })
}

async fn blocking<T: Send + 'static>(
    shared: &Arc<Shared>,
    f: impl FnOnce(&mut Engine) -> Result<T> + Send + 'static,
) -> Result<T> {
    let shared = Arc::clone(shared);
    tokio::task::spawn_blocking(move || f(&mut shared.engine())).await?
}
