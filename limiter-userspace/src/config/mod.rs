//! The rule file: parsing, validation, and the validated rule set.
//!
//! Every error names the file, the line and the field (`rules[2].limit.rate`)
//! and nothing is applied unless the whole file is valid.

mod locate;
mod raw;

use std::{
    collections::HashMap,
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use limiter_common::{
    abi::{DEFAULT_MAX_KEYS, MAX_RULES, RULE_NAME_LEN},
    gcra::Gcra,
    window::Window,
};
pub use raw::{Algorithm, Verdict};

/// The default rule file, used by the lab and shown in the README.
pub const EXAMPLE: &str = include_str!("../../../examples/rules.yaml");

/// A rule file that was rejected, and where.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub file: PathBuf,
    pub line: Option<usize>,
    /// The field, e.g. `rules[2].limit.rate`; empty for the whole file.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// A validated rule file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSet {
    /// For traffic that matches no rule.
    pub default: Verdict,
    /// For frames the parser rejects.
    pub malformed: Verdict,
    /// Capacity of the per-key state map.
    pub max_keys: u32,
    pub rules: Vec<Rule>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub matches: Match,
    /// Key granularity: the source prefix length that forms a key.
    pub key: KeyPrefix,
    pub limit: Limit,
    /// Budgets shared by all the rule's keys together (hierarchical limits).
    pub aggregate: Option<Meters>,
    /// How every meter of the rule counts.
    pub algorithm: Algorithm,
    /// Pacing (layer 7 only): how long a request may be held until it
    /// conforms before it is refused instead.
    pub delay: Option<Duration>,
    /// Excess is counted and passed instead of dropped.
    pub shadow: bool,
}

/// A packet meter, a byte meter, or both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meters {
    pub packets: Option<Meter>,
    pub bytes: Option<Meter>,
}

impl Rule {
    /// Identifies what the rule's buckets mean (match, key, limits, but not
    /// name or action): a reload keeps the buckets of a rule whose
    /// fingerprint did not change. FNV-1a over a canonical text, so it is
    /// the same in every build.
    pub fn fingerprint(&self) -> u64 {
        let meter = |m: &Option<Meter>| {
            m.map_or("-".to_owned(), |m| {
                format!("{}/{}ns/{}", m.rate, m.period.as_nanos(), m.burst)
            })
        };
        let meters = |m: &Option<Meters>| {
            m.map_or("-".to_owned(), |m| {
                format!("{},{}", meter(&m.packets), meter(&m.bytes))
            })
        };
        let limit = match self.limit {
            Limit::Unlimited => "unlimited".to_owned(),
            Limit::Metered { packets, bytes } => meters(&Some(Meters { packets, bytes })),
        };
        let m = &self.matches;
        let text = format!(
            "{:?}|{}|{}|{}|{}/{}|{limit}|{}",
            self.algorithm,
            m.source.map_or("*".to_owned(), |s| s.to_string()),
            m.protocol.map_or("*".to_owned(), |p| p.to_string()),
            m.dest_port.map_or("*".to_owned(), |p| p.to_string()),
            self.key.v4,
            self.key.v6,
            meters(&self.aggregate),
        );
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

/// What a rule applies to. `source: None` means every address of both families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Match {
    pub source: Option<IpNet>,
    pub protocol: Option<u8>,
    pub dest_port: Option<u16>,
}

/// Prefix lengths that form a key: one bucket per source `/v4` or `/v6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyPrefix {
    pub v4: u8,
    pub v6: u8,
}

impl KeyPrefix {
    /// One bucket per IPv4 address and per IPv6 /64 (one host owns a /64).
    pub const DEFAULT: Self = Self { v4: 32, v6: 64 };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Unlimited,
    Metered {
        packets: Option<Meter>,
        bytes: Option<Meter>,
    },
}

/// `rate` per `period`, with `burst` headroom, and its GCRA parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meter {
    pub rate: u64,
    pub period: Duration,
    /// GCRA only (windows admit `rate` per window).
    pub burst: u64,
    pub gcra: Gcra,
    pub window: Window,
}

impl RuleSet {
    /// Whether the kernel can enforce every rule: the sliding log and
    /// pacing need per-request logs and queues, which XDP cannot keep.
    pub fn kernel_compatible(&self) -> Result<(), String> {
        for (i, rule) in self.rules.iter().enumerate() {
            let what = if rule.algorithm == Algorithm::SlidingLog {
                "algorithm sliding_log"
            } else if rule.delay.is_some() {
                "limit.delay (pacing)"
            } else {
                continue;
            };
            return Err(format!(
                "rules[{i}] ({:?}): {what} works at layer 7 only (limiter proxy or the library); \
                 the kernel cannot queue or log requests",
                rule.name
            ));
        }
        Ok(())
    }

    /// Reads and validates a rule file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::parse(&read(path)?, path)
    }

    /// Validates rule-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        let raw: raw::RuleFile = from_yaml(text, origin)?;
        let locations = locate::Locations::index(text);
        validate(raw).map_err(|(field, message)| ConfigError {
            file: origin.to_owned(),
            line: locations.line(&field),
            field,
            message,
        })
    }
}

/// serde_yaml says `rules[0].limit: unknown field ... at line 6 column 14`;
/// the line is reported separately, the path becomes the field.
fn split_serde_message(message: &str) -> (String, String) {
    let message = message.split(" at line ").next().unwrap_or(message);
    match message.split_once(": ") {
        Some((path, rest))
            if !path.contains(' ')
                && path.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) =>
        {
            (path.to_owned(), rest.to_owned())
        }
        _ => (String::new(), message.to_owned()),
    }
}

type Invalid = (String, String);

fn invalid(field: impl Into<String>, message: impl Into<String>) -> Invalid {
    (field.into(), message.into())
}

fn validate(file: raw::RuleFile) -> Result<RuleSet, Invalid> {
    let max_keys = file.max_keys.unwrap_or(DEFAULT_MAX_KEYS);
    if max_keys == 0 {
        return Err(invalid("max_keys", "must be at least 1"));
    }
    if file.rules.len() >= MAX_RULES as usize {
        return Err(invalid(
            "rules",
            format!("{} rules; at most {} fit", file.rules.len(), MAX_RULES - 1),
        ));
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut matches: HashMap<Match, usize> = HashMap::new();
    let mut rules = Vec::with_capacity(file.rules.len());
    for (i, raw) in file.rules.iter().enumerate() {
        let at = |field: &str| format!("rules[{i}].{field}");
        let rule = validate_rule(raw).map_err(|(field, message)| (at(&field), message))?;
        if let Some(first) = names.insert(&raw.name, i) {
            return Err(invalid(
                at("name"),
                format!("duplicate name {:?} (also rules[{first}])", raw.name),
            ));
        }
        if let Some(first) = matches.insert(rule.matches, i) {
            return Err(invalid(
                at("match"),
                format!(
                    "same match as rules[{first}] ({:?}); one of them could never apply",
                    file.rules[first].name
                ),
            ));
        }
        rules.push(rule);
    }
    let rule_set = RuleSet {
        default: file.default,
        malformed: file.malformed,
        max_keys,
        rules,
    };
    crate::tables::check_fits(&rule_set)
        .map_err(|(i, message)| invalid(format!("rules[{i}].match"), message))?;
    Ok(rule_set)
}

fn validate_rule(raw: &raw::Rule) -> Result<Rule, Invalid> {
    if raw.name.is_empty() || raw.name.len() >= RULE_NAME_LEN {
        return Err(invalid(
            "name",
            format!("must be 1 to {} bytes long", RULE_NAME_LEN - 1),
        ));
    }
    let given = raw
        .matches
        .source
        .as_deref()
        .map(parse_prefix)
        .transpose()?;
    let source = given.map(|net| net.trunc());
    if let (Some(given), Some(net)) = (given, source)
        && given != net
    {
        return Err(invalid(
            "match.source",
            format!("{given} has host bits set; did you mean {net}?"),
        ));
    }
    let protocol = raw.matches.protocol.map(|p| p.0);
    if raw.matches.dest_port.is_some() && !matches!(protocol, Some(6 | 17 | 132)) {
        return Err(invalid(
            "match.dest_port",
            "needs protocol tcp, udp or sctp",
        ));
    }
    let matches = Match {
        source,
        protocol,
        dest_port: raw.matches.dest_port,
    };
    let algorithm = raw.algorithm.unwrap_or_default();
    let limit = match &raw.limit {
        raw::Limit::Unlimited => {
            let pointless = [
                ("key", raw.key.is_some()),
                ("action", raw.action.is_some()),
                ("aggregate", raw.aggregate.is_some()),
                ("algorithm", raw.algorithm.is_some()),
            ];
            if let Some((field, _)) = pointless.iter().find(|(_, set)| *set) {
                return Err(invalid(*field, "has no effect on an unlimited rule"));
            }
            Limit::Unlimited
        }
        raw::Limit::Rates(rates) => {
            let m = validate_rates(rates, algorithm).map_err(|(f, m)| (format!("limit.{f}"), m))?;
            Limit::Metered {
                packets: m.packets,
                bytes: m.bytes,
            }
        }
    };
    let delay = match &raw.limit {
        raw::Limit::Rates(raw::Rates {
            delay: Some(delay),
            bytes,
            ..
        }) => {
            let field = "limit.delay";
            if algorithm != Algorithm::Gcra || bytes.is_some() || raw.aggregate.is_some() {
                return Err(invalid(
                    field,
                    "pacing needs a gcra packet limit, without bytes or aggregate",
                ));
            }
            Some(
                humantime::parse_duration(delay)
                    .map_err(|e| invalid(field, format!("{delay:?}: {e}")))?,
            )
        }
        _ => None,
    };
    let aggregate = raw
        .aggregate
        .as_ref()
        .map(|rates| validate_rates(rates, algorithm))
        .transpose()
        .map_err(|(f, m)| (format!("aggregate.{f}"), m))?;
    Ok(Rule {
        name: raw.name.clone(),
        matches,
        key: parse_key(raw.key.as_deref(), source).map_err(|m| invalid("key", m))?,
        limit,
        aggregate,
        algorithm,
        delay,
        shadow: raw.action == Some(raw::Excess::Shadow),
    })
}

fn validate_rates(rates: &raw::Rates, algorithm: Algorithm) -> Result<Meters, Invalid> {
    let period = parse_unit(&rates.unit).map_err(|m| invalid("unit", m))?;
    let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX);
    let meter = |rate_field: &str, rate: Option<u64>, burst_field: &str, burst: Option<u64>| {
        let Some(rate) = rate else {
            return match burst {
                Some(_) => Err(invalid(
                    burst_field,
                    format!("given without `{rate_field}`"),
                )),
                None => Ok(None),
            };
        };
        if algorithm != Algorithm::Gcra && burst.is_some() {
            return Err(invalid(
                burst_field,
                "applies to gcra only: a window admits `rate` per window",
            ));
        }
        let burst = burst.unwrap_or(rate);
        let gcra =
            Gcra::new(rate, period_ns, burst).map_err(|e| invalid(rate_field, e.to_string()))?;
        let window = match algorithm {
            Algorithm::Gcra => Window::default(),
            _ => Window::new(rate, period_ns).map_err(|e| invalid(rate_field, e.to_string()))?,
        };
        Ok(Some(Meter {
            rate,
            period,
            burst,
            gcra,
            window,
        }))
    };
    let packets = meter("rate", rates.rate, "burst", rates.burst)?;
    let bytes = meter("bytes", rates.bytes, "burst_bytes", rates.burst_bytes)?;
    if packets.is_none() && bytes.is_none() {
        return Err(invalid(
            "rate",
            "a limit needs `rate` (packets), `bytes`, or both",
        ));
    }
    Ok(Meters { packets, bytes })
}

fn parse_prefix(text: &str) -> Result<IpNet, Invalid> {
    parse_net(text).map_err(|message| invalid("match.source", message))
}

/// An address prefix (`10.0.0.0/8`), or a single address (`/32`, `/128`).
pub fn parse_net(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| {
            format!("{text:?} is not an address prefix such as 10.0.0.0/8 or 2001:db8::/32")
        })
}

/// Reads a YAML file into `T`, with the file, line and field in errors.
pub fn load_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    from_yaml(&read(path)?, path)
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: path.to_owned(),
        line: None,
        field: String::new(),
        message: format!("cannot read: {e}"),
    })
}

/// Deserializes YAML text; errors carry the line and the field path.
fn from_yaml<T: serde::de::DeserializeOwned>(text: &str, origin: &Path) -> Result<T, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| {
        let (field, message) = split_serde_message(&e.to_string());
        ConfigError {
            file: origin.to_owned(),
            line: e.location().map(|l| l.line()),
            field,
            message,
        }
    })
}

/// `second`, `minute`, `hour`, `day`, or a duration such as `30s` or `250ms`.
pub fn parse_unit(unit: &str) -> Result<Duration, String> {
    let period = match unit {
        "second" => Duration::from_secs(1),
        "minute" => Duration::from_secs(60),
        "hour" => Duration::from_secs(3600),
        "day" => Duration::from_secs(86_400),
        other => humantime::parse_duration(other).map_err(|e| {
            format!("{other:?}: expected second, minute, hour, day or a duration like 30s ({e})")
        })?,
    };
    if period.is_zero() {
        return Err("must be longer than zero".into());
    }
    Ok(period)
}

/// `source` (whole address), `source/N`, or absent (the default: /32 for
/// IPv4, /64 for IPv6).
fn parse_key(key: Option<&str>, source: Option<IpNet>) -> Result<KeyPrefix, String> {
    let Some(key) = key else {
        return Ok(KeyPrefix::DEFAULT);
    };
    if key == "source" {
        return Ok(KeyPrefix { v4: 32, v6: 128 });
    }
    let bits = key
        .strip_prefix("source/")
        .and_then(|n| n.parse::<u8>().ok())
        .ok_or_else(|| format!("{key:?}: expected `source` or `source/N`"))?;
    match source.map(|net| net.addr()) {
        Some(IpAddr::V4(_)) if bits <= 32 => Ok(KeyPrefix {
            v4: bits,
            v6: KeyPrefix::DEFAULT.v6,
        }),
        Some(IpAddr::V6(_)) if bits <= 128 => Ok(KeyPrefix {
            v4: KeyPrefix::DEFAULT.v4,
            v6: bits,
        }),
        Some(IpAddr::V4(_)) => Err(format!("/{bits} is longer than an IPv4 address")),
        Some(IpAddr::V6(_)) => Err(format!("/{bits} is longer than an IPv6 address")),
        None => Err(format!(
            "source/{bits} needs match.source to tell whether it is an IPv4 or IPv6 prefix"
        )),
    }
}

#[cfg(test)]
mod tests;
