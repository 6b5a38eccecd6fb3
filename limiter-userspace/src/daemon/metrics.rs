//! The daemon's metrics endpoint: a scrape of the kernel's counters and
//! the daemon's gauges, in the format the scraper asks for.

use std::sync::{Arc, atomic::Ordering};

use super::{fleet::fleet_status, shared::Shared};
use crate::render::openmetrics::{self, Format};

pub async fn scrape(
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
