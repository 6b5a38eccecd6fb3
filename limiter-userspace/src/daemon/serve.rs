//! The daemon's running loop: the control socket's connections, the
//! signals, the metrics listener and the periodic tasks started, and the
//! kernel's decisions traced for a client.

use std::{sync::Arc, time::Duration};

use anyhow::Result;
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};

use super::{
    apply::reload_file,
    fleet::{KernelShares, sync_fleet},
    handle::handle,
    housekeeping::housekeeping,
    metrics::scrape,
    shared::Shared,
};
use crate::{
    control::{self, Response},
    fleet::Fleet,
    kernel,
    listen::{self, AcceptErrors, Slots},
    trace::{TraceFilter, TraceLine},
};

pub async fn serve(
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
