//! What the limiter shows people and scrapers: aligned terminal tables
//! with units ([`text`]) and the OpenMetrics exposition ([`openmetrics`]).
//! Renderers only render: the data comes assembled (a snapshot, a view,
//! or the layer-7 limiter's own counters).

pub mod openmetrics;
pub mod text;
