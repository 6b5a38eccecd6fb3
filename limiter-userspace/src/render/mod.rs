//! What the limiter shows people and scrapers: aligned terminal tables
//! with units ([`text`]) and the OpenMetrics exposition ([`openmetrics`]).
//! Renderers only render: the data comes assembled.

pub mod openmetrics;
pub mod text;
