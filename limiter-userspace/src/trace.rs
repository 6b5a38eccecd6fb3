//! Live decisions as `limiter trace` shows them, from either layer: the
//! filter an operator gives (`--source`, `--rule`, `--verdict`,
//! `--sample`), and one line per decision (time, interface, source,
//! protocol and port, rule, verdict, the meter that refused, what is left
//! of each budget), as text or JSON. The kernel's decisions come from
//! [`crate::kernel::trace`], layer 7's from the proxy.

use std::{fmt::Write as _, net::IpAddr};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;
use limiter_common::{
    abi::{KeyState, RuleConfig, algorithm, rule_flag},
    gcra::Gcra,
    keytable::window_state,
    meter::order,
    trace::{ANY_RULE, TraceConfig, TraceEvent, reason, verdict},
    window::WindowState,
};
use serde::{Deserialize, Serialize};

/// What to trace, as given on the command line (the rule by name).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceFilter {
    /// Sources in this prefix only.
    pub source: Option<IpNet>,
    /// This rule only.
    pub rule: Option<String>,
    /// These verdicts only (`verdict::name`); all when empty.
    pub verdicts: Vec<String>,
    /// This interface only (kernel).
    pub iface: Option<String>,
    /// Keep one matching decision in `sample`.
    pub sample: u32,
}

impl TraceFilter {
    /// The filter as both layers apply it, given the rule's id and the
    /// interface's index (resolved by the caller).
    pub fn config(&self, rule: Option<u32>, ifindex: u32) -> Result<TraceConfig> {
        let mut verdicts = 0;
        for name in &self.verdicts {
            let bit = (0..verdict::COUNT)
                .find(|&v| verdict::name(v) == name)
                .with_context(|| {
                    format!(
                        "--verdict {name:?}: not a verdict (one of {})",
                        verdict_names().join(", ")
                    )
                })?;
            verdicts |= 1 << bit;
        }
        let mut config = TraceConfig {
            on: 1,
            sample: self.sample.max(1),
            rule: rule.unwrap_or(ANY_RULE),
            verdicts: if verdicts == 0 {
                verdict::ALL
            } else {
                verdicts
            },
            ifindex,
            ..TraceConfig::default()
        };
        if let Some(prefix) = self.source {
            config.prefix_len = prefix.prefix_len();
            match prefix.network() {
                IpAddr::V4(a) => {
                    config.family = 4;
                    config.addr[..4].copy_from_slice(&a.octets());
                }
                IpAddr::V6(a) => {
                    config.family = 6;
                    config.addr = a.octets();
                }
            }
        }
        Ok(config)
    }
}

fn verdict_names() -> Vec<&'static str> {
    (0..verdict::COUNT).map(verdict::name).collect()
}

/// Parses `--source`: a prefix, or one address.
pub fn parse_source(text: &str) -> Result<IpNet> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    match text.parse::<IpAddr>() {
        Ok(addr) => Ok(IpNet::from(addr)),
        Err(_) => {
            bail!("--source {text:?}: not an address or a prefix (198.18.0.1, 198.18.0.0/16)")
        }
    }
}

/// One decision, as printed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceLine {
    /// RFC 3339, microseconds, UTC.
    pub time: String,
    /// `xdp` or `http`.
    pub layer: String,
    /// The interface (kernel), or the proxy's listening address.
    pub interface: String,
    /// None for a frame too malformed to have one.
    pub source: Option<IpAddr>,
    /// `tcp`, `udp`, `icmp`, `proto 47`, `http`, ...
    pub protocol: String,
    pub port: Option<u16>,
    pub rule: String,
    pub verdict: String,
    /// The meter or cause that refused it; none when passed.
    pub refused_by: Option<String>,
    /// Each budget of the rule, as it stood after the decision.
    pub left: Vec<Left>,
    /// Frame or request length in bytes.
    pub bytes: u64,
    /// Layer 7: the request as it was judged (and forwarded): its
    /// canonical host, its path as nginx routes it, and the values of the
    /// fields its rule's key is made of (`header:NAME`), by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<JudgedRequest>,
}

/// What layer 7 judged of a request (`TraceLine::request`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JudgedRequest {
    pub host: Option<String>,
    pub path: String,
    pub fields: Vec<(String, String)>,
}

/// What is left of one budget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Left {
    /// `key packets`, `key bytes`, `aggregate packets`, `aggregate bytes`
    /// (at layer 7 packets are requests).
    pub meter: String,
    pub left: u64,
    /// The budget's whole size (a burst, or a window's limit).
    pub of: u64,
}

impl TraceLine {
    /// Aligned text: time, interface, source, protocol/port, rule,
    /// verdict, then why and what is left.
    pub fn text(&self) -> String {
        let time = self.time.get(11..26).unwrap_or(&self.time);
        let source = self
            .source
            .map_or_else(|| "-".to_owned(), |s| s.to_string());
        let proto = match self.port {
            Some(port) => format!("{}/{port}", self.protocol),
            None => self.protocol.clone(),
        };
        let mut line = format!(
            "{time:<15}  {:<10} {source:<16} {proto:<10} {:<14} {:<9}",
            self.interface, self.rule, self.verdict
        );
        if let Some(by) = &self.refused_by {
            let _ = write!(line, " by {by}");
        }
        if !self.left.is_empty() {
            line.push_str("  left:");
            for (i, left) in self.left.iter().enumerate() {
                let sep = if i == 0 { " " } else { ", " };
                let _ = write!(line, "{sep}{} {} of {}", left.meter, left.left, left.of);
            }
        }
        line.trim_end().to_owned()
    }
}

/// The header of the text lines.
pub fn header() -> String {
    format!(
        "{:<15}  {:<10} {:<16} {:<10} {:<14} {:<9} why, and what is left",
        "TIME", "INTERFACE", "SOURCE", "PROTO", "RULE", "VERDICT"
    )
}

/// Now on `CLOCK_REALTIME`, as a trace line's time.
pub fn time_of(realtime_ns: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(realtime_ns);
    humantime::format_rfc3339_micros(t).to_string()
}

/// The protocol's name for a trace line.
pub fn protocol_name(protocol: u8) -> String {
    match protocol {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        132 => "sctp".into(),
        p => format!("proto {p}"),
    }
}

/// What is left of each budget of `rule` after a kernel decision, at
/// the event's time (`realtime_offset_ns`: the epoch's, which windows
/// count in).
pub fn kernel_budgets(
    rule: &RuleConfig,
    third: Option<&Gcra>,
    event: &TraceEvent,
    realtime_offset_ns: u64,
) -> Vec<Left> {
    let now = event.time_ns;
    let epoch_now = now.wrapping_add(realtime_offset_ns);
    let key = KeyState {
        meters: event.key_state,
        ..KeyState::default()
    };
    let sliding = rule.algorithm == algorithm::SLIDING_WINDOW;
    let meters = [
        (rule_flag::LIMIT_PACKETS, &rule.packets, order::KEY_PACKETS),
        (rule_flag::LIMIT_BYTES, &rule.bytes, order::KEY_BYTES),
        (
            rule_flag::AGGREGATE_PACKETS,
            rule.aggregate_packets_at(now),
            order::AGGREGATE_PACKETS,
        ),
        (
            rule_flag::AGGREGATE_BYTES,
            &rule.aggregate_bytes,
            order::AGGREGATE_BYTES,
        ),
    ];
    let mut left = Vec::new();
    for (flag, meter, i) in meters {
        let aggregate = order::is_aggregate(i);
        if rule.flags & flag == 0 || (!aggregate && event.has_key == 0) {
            continue;
        }
        let pair = if aggregate { i - 2 } else { i };
        let (remaining, of) = if rule.algorithm == algorithm::GCRA {
            let tat = if aggregate {
                event.aggregate[pair][0]
            } else {
                event.key_state[pair]
            };
            (meter.gcra.remaining(tat, now), meter.gcra.burst)
        } else {
            let state = if aggregate {
                let [start, previous, current] = event.aggregate[pair];
                WindowState {
                    start,
                    previous,
                    current,
                }
            } else {
                window_state(&key, pair + 1)
            };
            (
                meter.window.remaining(&state, epoch_now, sliding),
                meter.window.limit,
            )
        };
        left.push(Left {
            meter: meter_name(rule, i as u8).to_owned(),
            left: remaining,
            of,
        });
    }
    // A third limit, in the key's third word.
    if let Some(third) = third.filter(|_| rule.flags & rule_flag::THIRD_LIMIT != 0)
        && event.has_key != 0
    {
        left.push(Left {
            meter: meter_name(rule, order::KEY_THIRD as u8).to_owned(),
            left: third.remaining(event.key_state[2], now),
            of: third.burst,
        });
    }
    left
}

/// A kernel rule's meter `i` (`meter::order`) as a trace line names it:
/// the byte meter is the key's second packet limit when the rule has one.
pub fn meter_name(rule: &RuleConfig, i: u8) -> &'static str {
    let has = |flag: u32| rule.flags & flag != 0;
    limit_name(
        i,
        has(rule_flag::BYTES_COUNT_PACKETS),
        has(rule_flag::THIRD_COUNTS_BYTES),
    )
}

/// Meter (or cause) `i`'s name, given what the key's byte meter and its
/// third word count, in both layers.
pub fn limit_name(i: u8, second_counts_packets: bool, third_counts_bytes: bool) -> &'static str {
    match usize::from(i) {
        order::KEY_BYTES if second_counts_packets => "key packets (second limit)",
        order::KEY_THIRD if third_counts_bytes => "key bytes (third limit)",
        order::KEY_THIRD => "key packets (third limit)",
        _ => reason::name(i),
    }
}

/// The refusal's cause as a trace line names it.
pub fn refused_by(reason: u8) -> Option<String> {
    (reason != reason::NONE).then(|| reason::name(reason).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use limiter_common::gcra::Gcra;

    #[test]
    fn a_filter_becomes_the_kernel_config() {
        let filter = TraceFilter {
            source: Some(parse_source("198.18.0.1").unwrap()),
            verdicts: vec!["dropped".into(), "blocked".into()],
            sample: 0,
            ..TraceFilter::default()
        };
        let config = filter.config(Some(3), 7).unwrap();
        assert_eq!(config.ifindex, 7);
        assert_eq!(config.family, 4);
        assert_eq!(config.prefix_len, 32);
        assert_eq!(&config.addr[..4], &[198, 18, 0, 1]);
        assert_eq!(config.rule, 3);
        assert_eq!(
            config.verdicts,
            (1 << verdict::DROPPED) | (1 << verdict::BLOCKED)
        );
        assert_eq!(config.sample, 1);
        let wrong = TraceFilter {
            verdicts: vec!["dopped".into()],
            ..TraceFilter::default()
        };
        let error = wrong.config(None, 0).unwrap_err().to_string();
        assert!(
            error.contains("\"dopped\"") && error.contains("dropped"),
            "{error}"
        );
        assert!(parse_source("198.18.0.0/15").unwrap().to_string() == "198.18.0.0/15");
        assert!(parse_source("198.18.0.0/").is_err());
    }

    #[test]
    fn budgets_left_come_from_the_state() {
        // 10 packets a second, burst 5: a key that took 3 at once has 2 left.
        let gcra = Gcra::new(10, 1_000_000_000, 5).unwrap();
        let mut rule = RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            ..RuleConfig::default()
        };
        rule.packets.gcra = gcra;
        let now = 50_000_000_000;
        let mut tat = now;
        for _ in 0..3 {
            match gcra.check(tat, now, 1) {
                limiter_common::gcra::Check::Allow { new_tat } => tat = new_tat,
                limiter_common::gcra::Check::Deny => panic!("within the burst"),
            }
        }
        let event = TraceEvent {
            time_ns: now,
            key_state: [tat, 0, 0],
            has_key: 1,
            ..TraceEvent::default()
        };
        let left = kernel_budgets(&rule, None, &event, 0);
        assert_eq!(
            left,
            vec![Left {
                meter: "key packets".into(),
                left: 2,
                of: 5
            }]
        );
        let keyless = TraceEvent {
            has_key: 0,
            ..event
        };
        assert!(kernel_budgets(&rule, None, &keyless, 0).is_empty());
        // A third limit (250 a day) that took the same 3: 247 left.
        let day = Gcra::new(250, 86_400_000_000_000, 250).unwrap();
        rule.flags |= rule_flag::THIRD_LIMIT;
        let third = TraceEvent {
            key_state: [tat, 0, now + 3 * day.emission_ns],
            ..event
        };
        assert_eq!(
            kernel_budgets(&rule, Some(&day), &third, 0)[1],
            Left {
                meter: "key packets (third limit)".into(),
                left: 247,
                of: 250
            }
        );
        // The third word of a rule without a third limit (a soft limit's
        // meter is kept there) is no budget.
        rule.flags &= !rule_flag::THIRD_LIMIT;
        assert_eq!(kernel_budgets(&rule, Some(&day), &third, 0).len(), 1);
    }

    #[test]
    fn a_window_keys_budget_is_its_limit_less_its_count() {
        use limiter_common::{
            abi::algorithm,
            keytable::pack_counts,
            window::{Window, WindowState},
        };
        let second = 1_000_000_000;
        let start = 1_700_000_000 * second;
        let mut rule = RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            algorithm: algorithm::FIXED_WINDOW,
            ..RuleConfig::default()
        };
        rule.packets.window = Window::new(10, second).unwrap();
        let counts = pack_counts(&WindowState {
            start,
            previous: 0,
            current: 4,
        });
        let event = TraceEvent {
            time_ns: start + second / 2,
            key_state: [start, counts, 0],
            has_key: 1,
            ..TraceEvent::default()
        };
        assert_eq!(
            kernel_budgets(&rule, None, &event, 0),
            vec![Left {
                meter: "key packets".into(),
                left: 6,
                of: 10
            }]
        );
    }

    #[test]
    fn text_lines_are_aligned_and_say_why() {
        let line = TraceLine {
            time: "2026-12-01T12:00:00.123456Z".into(),
            layer: "xdp".into(),
            interface: "veth0".into(),
            source: Some("198.18.0.1".parse().unwrap()),
            protocol: "udp".into(),
            port: Some(53),
            rule: "dns".into(),
            verdict: "dropped".into(),
            refused_by: Some("key packets".into()),
            left: vec![Left {
                meter: "key packets".into(),
                left: 0,
                of: 100,
            }],
            bytes: 60,
            request: None,
        };
        let text = line.text();
        assert!(
            text.starts_with("12:00:00.123456  veth0      198.18.0.1       udp/53"),
            "{text}"
        );
        assert!(
            text.ends_with("dropped   by key packets  left: key packets 0 of 100"),
            "{text}"
        );
    }
}
