//! `limiter daemon`'s start-up: the configuration and rules loaded, the
//! program attached or adopted, the listeners bound and the capabilities
//! dropped, before the runtime starts.

use std::{
    path::Path,
    sync::{Arc, Mutex, atomic::AtomicU64},
};

use anyhow::{Context, Result};
use tokio::sync::Notify;

use super::{config::DaemonConfig, serve::serve, shared::Shared};
use crate::{
    control,
    engine::Engine,
    kernel::{
        capabilities,
        links::LINKS_DIR,
        pins::{self, PinLock},
        require_root,
    },
    rules::RuleSet,
};

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
