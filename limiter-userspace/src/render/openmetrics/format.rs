//! The two exposition formats, chosen by the scraper's `Accept`:
//! OpenMetrics as rendered, or rewritten in the classic text format.

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format 0.0.4: what `curl`, `promtool check
    /// metrics` and most scrapers read.
    Classic,
    OpenMetrics,
}

impl Format {
    /// What an `Accept` header asks for: OpenMetrics when it ranks
    /// `application/openmetrics-text` at least as high as any other type it
    /// accepts (as Prometheus does), the classic format otherwise.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut other) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut params = range.split(';').map(str::trim);
            let media = params.next().unwrap_or("").to_ascii_lowercase();
            let q = params
                .filter_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            if media == "application/openmetrics-text" {
                openmetrics = openmetrics.max(q);
            } else if !media.is_empty() {
                other = other.max(q);
            }
        }
        if openmetrics > 0.0 && openmetrics >= other {
            Self::OpenMetrics
        } else {
            Self::Classic
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Classic => "text/plain; version=0.0.4; charset=utf-8",
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// An exposition rendered by this module, in this format.
    pub fn encode(self, openmetrics: String) -> String {
        match self {
            Self::OpenMetrics => openmetrics,
            Self::Classic => to_classic(&openmetrics),
        }
    }
}

/// Rewrites an OpenMetrics exposition, as prometheus-client writes it, in
/// the classic text format: no `# UNIT` or `# EOF`, each counter declared
/// under its `_total` samples' name, each info family as an `_info` gauge.
/// (prometheus-client writes a family's `# HELP` before its `# TYPE`, so the
/// help waits for the type that decides its name.)
fn to_classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                _ => (name.to_owned(), "untyped"),
            };
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if !(line.starts_with("# UNIT ") || line == "# EOF") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{Format, to_classic};

    #[test]
    fn accept_chooses_the_format() {
        assert_eq!(Format::negotiate(None), Format::Classic);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Classic);
        assert_eq!(
            Format::negotiate(Some("text/plain;version=0.0.4")),
            Format::Classic
        );
        // What Prometheus 2.x sends.
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
            )),
            Format::OpenMetrics
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0.2, text/plain")),
            Format::Classic
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Classic
        );
    }

    #[test]
    fn classic_names_counters_and_info_by_their_samples() {
        let openmetrics = "# HELP limiter_packets Packets judged.\n# TYPE limiter_packets counter\nlimiter_packets_total{rule=\"a\"} 3\n# HELP limiter_bytes Bytes judged.\n# TYPE limiter_bytes counter\n# UNIT limiter_bytes bytes\nlimiter_bytes_total 9\n# HELP limiter_blocks Blocks.\n# TYPE limiter_blocks gauge\nlimiter_blocks 1\n# HELP limiter_build Version.\n# TYPE limiter_build info\nlimiter_build_info{version=\"1\"} 1\n# EOF\n";
        assert_eq!(
            to_classic(openmetrics),
            "# HELP limiter_packets_total Packets judged.\n# TYPE limiter_packets_total counter\nlimiter_packets_total{rule=\"a\"} 3\n# HELP limiter_bytes_total Bytes judged.\n# TYPE limiter_bytes_total counter\nlimiter_bytes_total 9\n# HELP limiter_blocks Blocks.\n# TYPE limiter_blocks gauge\nlimiter_blocks 1\n# HELP limiter_build_info Version.\n# TYPE limiter_build_info gauge\nlimiter_build_info{version=\"1\"} 1\n"
        );
    }
}
