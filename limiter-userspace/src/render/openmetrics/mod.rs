//! Prometheus (OpenMetrics) exposition of the counters, of the kernel
//! (`layer="xdp"`) and of a layer-7 limiter (`layer="http"`, the same
//! names). Names follow the conventions: `_total` counters, base units
//! (bytes), and the labels `layer`, `interface`, `rule` and `verdict`.
//! Served in the format the scraper's `Accept` asks for ([`Format`]):
//! OpenMetrics on request, else the classic text format that every reader
//! of Prometheus metrics takes.

mod common;
mod format;
mod kernel;
mod layer7;

pub use format::Format;
pub use kernel::{DaemonGauges, render};
pub use layer7::render_http;
