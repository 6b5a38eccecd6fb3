//! The CLI's subcommands, one function each: they parse nothing (clap
//! did), call the library, and print through [`limiter::render`] (or JSON).

pub mod lab;
pub mod lab_fleet;
pub mod run;
pub mod top;
pub mod trace;

use std::{path::Path, time::Duration};

use anyhow::{Context, Result};
use limiter::{
    control::Client,
    kernel::{self, Maps, counters, require_root},
    render::{openmetrics, text},
    rules::RuleSet,
    units::count,
};

/// From the daemon if one answers on `socket`, else from the pins of
/// whatever limiter runs (`limiter run` has no socket).
pub fn stats(pin_dir: &Path, socket: &Path, json: bool, watch: bool) -> Result<()> {
    require_root()?;
    let daemon = Client::new(socket);
    let maps = if daemon.daemon_running() {
        None
    } else {
        Some(Maps::open_pinned(pin_dir)?)
    };
    loop {
        let snapshot = match &maps {
            Some(maps) => counters::read(maps)?,
            None => daemon.stats()?,
        };
        if json {
            println!("{}", serde_json::to_string(&snapshot)?);
        } else {
            if watch {
                print!("\x1b[2J\x1b[H");
            }
            print!("{}", text::stats_table(&snapshot));
        }
        if !watch {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

pub fn rules_apply(file: &Path, socket: &Path, json: bool) -> Result<()> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("{}: cannot read", file.display()))?;
    // Validate here too, so a wrong file is reported even with no daemon.
    RuleSet::parse(&text, file)?;
    let origin = file.display().to_string();
    let change = Client::new(socket).rules_apply(text, origin)?;
    if json {
        println!("{}", serde_json::to_value(&change)?);
        return Ok(());
    }
    println!(
        "applied {} (generation {}):",
        file.display(),
        change.generation
    );
    for (what, names) in [
        ("added", &change.added),
        ("removed", &change.removed),
        ("modified (new buckets)", &change.modified),
        ("new limits (state carried)", &change.carried),
        ("unchanged (buckets kept)", &change.unchanged),
    ] {
        if !names.is_empty() {
            println!("  {what:<27} {}", names.join(", "));
        }
    }
    if change.forgotten_keys > 0 {
        println!(
            "  {} keys of removed or modified rules forgotten",
            count(change.forgotten_keys as u64)
        );
    }
    Ok(())
}

pub fn rules_show(socket: &Path, json: bool) -> Result<()> {
    let view = Client::new(socket).rules_show()?;
    if json {
        println!("{}", serde_json::to_value(&view)?);
    } else {
        print!("{}", text::rules_view_text(&view));
    }
    Ok(())
}

pub fn block(socket: &Path, prefix: String, duration: Option<Duration>) -> Result<()> {
    let what = prefix.clone();
    Client::new(socket).block(prefix, duration.map(|d| d.as_secs_f64()))?;
    match duration {
        Some(d) => println!("blocked {what} for {}", humantime::format_duration(d)),
        None => println!("blocked {what} until `limiter unblock {what}`"),
    }
    Ok(())
}

pub fn unblock(socket: &Path, prefix: String) -> Result<()> {
    let what = prefix.clone();
    Client::new(socket).unblock(prefix)?;
    println!("unblocked {what}");
    Ok(())
}

pub fn shadow(socket: &Path, rule: Option<String>, on: bool) -> Result<()> {
    let what = rule
        .clone()
        .map_or("every rule".to_owned(), |r| format!("rule {r:?}"));
    Client::new(socket).shadow(rule, on)?;
    println!("dry run {} for {what}", if on { "on" } else { "off" });
    Ok(())
}

/// Through the daemon if one runs (it exits after), else directly.
pub fn detach(pin_dir: &Path, socket: &Path) -> Result<()> {
    require_root()?;
    let daemon = Client::new(socket);
    let detached: Vec<String> = if daemon.daemon_running() {
        daemon.detach()?.detached
    } else {
        // A daemon that answers on another socket still holds the pins (and
        // would pin again what was removed under it): refused, by its lock.
        let _lock = kernel::pins::PinLock::acquire(pin_dir).with_context(|| {
            format!(
                "no daemon answers on {}, but one holds {}: detach through its socket (--socket)",
                socket.display(),
                pin_dir.display()
            )
        })?;
        kernel::detach_all(pin_dir)?
    };
    if detached.is_empty() {
        println!(
            "no pinned links under {}; removed the pins there",
            pin_dir.display()
        );
    } else {
        println!(
            "detached from {} and removed {}",
            detached.join(", "),
            pin_dir.display()
        );
    }
    Ok(())
}

pub fn check(path: &Path, json: bool) -> Result<()> {
    let set = RuleSet::load(path)?;
    if json {
        let rules: Vec<_> = set
            .rules
            .iter()
            .map(|r| {
                let described = limiter::rules::describe::describe(r);
                serde_json::json!({
                    "name": r.name,
                    "source": r.matches.source.map(|s| s.to_string()),
                    "protocol": r.matches.protocol,
                    "dest_port": r.matches.dest_port,
                    "key": { "ipv4": r.key.v4, "ipv6": r.key.v6 },
                    "key_parts": r.keyed_by.iter().map(|p| p.name()).collect::<Vec<_>>(),
                    "layer7_only": r.layer7_field(),
                    "matches": described.matches,
                    "limit": described.limit,
                    "aggregate": described.aggregate,
                    "policies": limiter::rules::describe::policies_json(r),
                    "shadow": r.shadow,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "file": path, "valid": true, "rules": rules })
        );
    } else {
        println!("{}: valid, {} rules\n", path.display(), set.rules.len());
        print!("{}", text::rules_table(&set));
        if let Err(why) = set.kernel_compatible() {
            println!("\nnote: for `limiter proxy` and the library only: {why}");
        }
    }
    Ok(())
}

pub fn proxy(
    options: limiter::http::proxy::Options,
    config: &Path,
    fleet: Option<&Path>,
    watch: bool,
) -> Result<()> {
    use std::sync::Arc;
    let rules = RuleSet::load(config)?;
    let fleet_config = fleet
        .map(|path| {
            let fleet: limiter::fleet::FleetConfig = limiter::yaml::load(path)?;
            fleet
                .validate("fleet")
                .with_context(|| path.display().to_string())?;
            anyhow::Ok(fleet)
        })
        .transpose()?;
    let limiter = Arc::new(limiter::http::Reloadable::new(Arc::new(
        limiter::http::Limiter::new(rules, Arc::new(limiter::http::SystemClock)),
    )));
    let upstream = options.upstream.clone();
    let config = config.to_owned();
    // Requests have threads of their own (the proxy's workers): this one
    // runs the metrics, reloads and the fleet's leases.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?
        .block_on(async move {
            let mut fleet = limiter::fleet::Fleet::new(fleet_config, Arc::clone(&limiter) as _);
            fleet.sync(&limiter.current().rules().rules);
            let status = fleet.status();
            tokio::spawn(reload_rules(config, Arc::clone(&limiter), fleet, watch));
            let reloads = Arc::clone(&limiter);
            let tracer = options.trace.clone();
            let render: limiter::http::proxy::RenderMetrics = Arc::new(move |limiter, accept| {
                let shares: Vec<_> = status
                    .lock()
                    .expect("fleet status")
                    .values()
                    .cloned()
                    .collect();
                let format = openmetrics::Format::negotiate(accept);
                let text = openmetrics::render_http(
                    limiter,
                    &shares,
                    reloads.refusals(),
                    tracer.as_ref().map(|t| t.dropped()),
                );
                (format.content_type(), format.encode(text))
            });
            limiter::http::proxy::serve(options, limiter, render, |addr| {
                println!("limiter proxy: listening on {addr}, forwarding to {upstream}")
            })
            .await
        })
}

/// Re-reads the proxy's rule file on SIGHUP (and when it changes on disk,
/// with `watch`): a valid one goes in force keeping the buckets of the
/// rules it does not change; an invalid one is reported and changes
/// nothing.
async fn reload_rules(
    path: std::path::PathBuf,
    limiter: std::sync::Arc<limiter::http::Reloadable>,
    mut fleet: limiter::fleet::Fleet,
    watch: bool,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangup) = signal(SignalKind::hangup()) else {
        tracing::error!("cannot catch SIGHUP: the rule file is read once");
        return;
    };
    let mut rule_file = limiter::rules::watch::FileWatch::new(&path);
    let mut poll = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = hangup.recv() => tracing::info!("SIGHUP: re-reading {}", path.display()),
            _ = poll.tick(), if watch => {
                if !rule_file.changed() {
                    continue;
                }
                tracing::info!("{} changed on disk: re-reading it", path.display());
            }
        }
        rule_file.read();
        match RuleSet::load(&path) {
            Ok(rules) => {
                let total = rules.rules.len();
                let kept = limiter.reload(rules);
                fleet.sync(&limiter.current().rules().rules);
                tracing::info!(
                    event = "rules_applied",
                    origin = %path.display(),
                    kept,
                    total,
                    "applied {}: {kept} of {total} rules kept their buckets",
                    path.display()
                );
            }
            Err(e) => {
                limiter.refused();
                tracing::error!(
                    event = "rules_rejected",
                    origin = %path.display(),
                    error = %e,
                    "{e}; nothing changed"
                )
            }
        }
    }
}

pub fn import_envoy(file: &Path, routes: Option<&Path>) -> Result<()> {
    let conversion = limiter::import::envoy(file, routes)?;
    print!("{}", conversion.rules);
    for line in &conversion.skipped {
        eprintln!("not converted: {line}");
    }
    if !conversion.skipped.is_empty() {
        eprintln!("{} descriptors not converted", conversion.skipped.len());
    }
    Ok(())
}
