//! The control socket's requests, answered: status, stats, rules, blocks,
//! dry runs and detaching, each engine call on a blocking thread.

use std::{sync::Arc, sync::atomic::Ordering, time::Duration};

use anyhow::{Context, Result};

use super::{apply::apply, fleet::fleet_status, shared::Shared};
use crate::{
    control::{Request, Response},
    engine::Engine,
    kernel, rules,
    wire::{Detached, Status},
};

pub async fn handle(shared: &Arc<Shared>, request: Request) -> Result<Response> {
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
            let net = rules::parse_net(&prefix)?;
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
            let net = rules::parse_net(&prefix)?;
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
