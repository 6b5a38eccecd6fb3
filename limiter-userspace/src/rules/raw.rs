//! The rule file exactly as written: serde shapes with no cross-field
//! checks. Unknown fields are errors, so a typo never silently disables a
//! limit. `validate` turns this into a [`super::RuleSet`].

use std::fmt;

use limiter_common::abi::UNKNOWN_PROTOCOL;
use serde::{
    Deserialize, Deserializer,
    de::{self, MapAccess, Visitor, value::MapAccessDeserializer},
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleFile {
    #[serde(default)]
    pub default: Fallback,
    #[serde(default)]
    pub malformed: Fallback,
    pub max_keys: Option<u32>,
    /// Each rule's budget of key creations, `{ rate, unit, burst }`.
    pub new_keys: Option<RateFields>,
    /// What bounds the blocks rules' `escalate` makes.
    pub escalation: Option<EscalationPolicyFields>,
    /// Later fragments whose first fragment was not seen.
    #[serde(default)]
    pub fragments: FragmentPolicy,
    #[serde(default)]
    pub rules: Vec<RuleEntry>,
}

/// What becomes of a later fragment whose first fragment was not seen
/// (lost, or sent last: its port, and so its rule, is unknown): charged
/// to the strictest rule of its source it may belong to, or dropped.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FragmentPolicy {
    #[default]
    Strictest,
    Drop,
}

/// `escalation: { never_block: [prefix, ...], max_per_minute: N }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EscalationPolicyFields {
    pub never_block: Option<Vec<String>>,
    pub max_per_minute: Option<u32>,
}

/// What happens to traffic no rule matches (`default`) and to frames the
/// parser rejects (`malformed`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Fallback {
    #[default]
    Pass,
    Drop,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleEntry {
    pub name: String,
    #[serde(default, rename = "match")]
    pub matches: MatchFields,
    /// `source`, `source/N`, or (layer 7) `header:NAME`, `path`, `method`,
    /// `host`; one or a list, whose parts together form the key.
    pub key: Option<Strings>,
    /// One limit (`limit`), or several (`limits`): exactly one of them.
    pub limit: Option<LimitField>,
    /// Several limits on the same key, all of which a packet must pass:
    /// two at most (two packet rates, or a packet and a byte rate), each
    /// with its unit.
    pub limits: Option<Vec<RateFields>>,
    /// One budget shared by every key of the rule.
    pub aggregate: Option<RateFields>,
    /// A packet (request) rate below `limit`'s: above it, traffic is
    /// counted as over it and still passed.
    pub soft: Option<RateFields>,
    /// Block a key that stays over its limit `after` this long, for `block`.
    pub escalate: Option<EscalateFields>,
    /// What one packet (request) costs its packet meters, by class: the
    /// first class it is in; 1 when none.
    pub cost: Option<Vec<CostEntry>>,
    pub action: Option<Excess>,
    pub algorithm: Option<Algorithm>,
    /// Layer 7: at most this many requests of one key in flight at once.
    pub concurrent: Option<u32>,
}

/// How a limit is metered.
#[derive(Clone, Copy, Debug, Default, Deserialize, serde::Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Token bucket as a meter: one TAT per key.
    #[default]
    Gcra,
    /// Envoy's: at most `rate` per window, windows aligned to the epoch.
    FixedWindow,
    /// Cloudflare's weighted estimate over the current and previous window.
    SlidingWindow,
    /// Exact: a log of the last window's requests per key (layer 7 only).
    SlidingLog,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchFields {
    /// Parsed by `validate`, for a message that shows what is expected.
    pub source: Option<String>,
    pub protocol: Option<Protocol>,
    pub dest_port: Option<u16>,
    /// TCP flags, named and negated with `!`: `syn,!ack`.
    pub tcp_flags: Option<String>,
    /// Layer 7: one method or a list.
    pub method: Option<Strings>,
    /// Layer 7: the request's host, without its port.
    pub host: Option<String>,
    /// Layer 7: the exact path (without the query).
    pub path: Option<String>,
    /// Layer 7: a prefix of the path.
    pub path_prefix: Option<String>,
    /// Layer 7: header conditions, every one of which must hold.
    pub headers: Option<Vec<HeaderFields>>,
}

/// A header condition: `{ name, equals }` or `{ name, present }`
/// (`present: true` when neither is given).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderFields {
    pub name: String,
    pub equals: Option<String>,
    pub present: Option<bool>,
}

/// One string or a list of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strings(pub Vec<String>);

impl<'de> Deserialize<'de> for Strings {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StringsVisitor;
        impl<'de> Visitor<'de> for StringsVisitor {
            type Value = Strings;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Strings, E> {
                Ok(Strings(vec![v.to_owned()]))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Strings, A::Error> {
                let mut all = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    all.push(s);
                }
                Ok(Strings(all))
            }
        }
        deserializer.deserialize_any(StringsVisitor)
    }
}

/// `tcp`, `udp`, `icmp`, `icmpv6`, `sctp`, or an IP protocol number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol(pub u8);

impl<'de> Deserialize<'de> for Protocol {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ProtocolVisitor;
        impl Visitor<'_> for ProtocolVisitor {
            type Value = Protocol;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "tcp, udp, icmp, icmpv6, sctp or a protocol number 0-254 (255 is reserved)",
                )
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Protocol, E> {
                u8::try_from(v)
                    .ok()
                    .filter(|&p| p != UNKNOWN_PROTOCOL)
                    .map(Protocol)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Protocol, E> {
                Ok(Protocol(match v {
                    "tcp" => 6,
                    "udp" => 17,
                    "icmp" => 1,
                    "icmpv6" => 58,
                    "sctp" => 132,
                    _ => return Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }))
            }
        }
        deserializer.deserialize_any(ProtocolVisitor)
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Excess {
    Drop,
    Shadow,
}

/// `unlimited`, or a mapping of rates.
#[derive(Debug)]
pub enum LimitField {
    Unlimited,
    Rates(RateFields),
}

/// One class of `cost`: `{ match: { tcp_flags: "syn,!ack" }, credits: 10 }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostEntry {
    #[serde(rename = "match")]
    pub matches: MatchFields,
    pub credits: u64,
}

/// `escalate: { after: 10s, block: 10m }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EscalateFields {
    pub after: String,
    pub block: String,
    /// `key` (the default: the rule's own limit holds the key) or
    /// `source` (every packet of the key's source prefix is dropped).
    pub scope: Option<EscalateScope>,
}

/// What an escalation blocks at layer 3/4.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum EscalateScope {
    /// The key under this rule only: its meter refuses everything for
    /// `block`. Evidence a forger can produce then costs the victim no
    /// more than the forgery already did.
    #[default]
    Key,
    /// Every packet of the key's source prefix, before any rule, as
    /// `limiter block` does: forged refusals can block a victim.
    Source,
}

/// The fields of a `limit` or `aggregate` mapping.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateFields {
    /// Packets per unit.
    pub rate: Option<u64>,
    /// Bytes per unit.
    pub bytes: Option<u64>,
    pub unit: String,
    pub burst: Option<u64>,
    pub burst_bytes: Option<u64>,
    /// Pacing (layer 7 only): hold a request up to this long until it
    /// conforms, instead of refusing it.
    pub delay: Option<String>,
    /// `aggregate` only: `fleet` shares the budget among every node that
    /// has the rule, through leases (see `crate::fleet`).
    pub scope: Option<Scope>,
    /// `scope: fleet`: how many equal parts the budget is leased in.
    pub partitions: Option<u32>,
    /// `scope: fleet`: what each node keeps whatever the store says, in
    /// packets (requests) per `unit`.
    pub reserve: Option<u64>,
}

/// Whose budget an aggregate is.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// This node's alone.
    #[default]
    Local,
    /// The whole fleet's: each node enforces its leased share.
    Fleet,
}

impl<'de> Deserialize<'de> for LimitField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LimitVisitor;
        impl<'de> Visitor<'de> for LimitVisitor {
            type Value = LimitField;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`unlimited` or a mapping such as { rate: 100, unit: second }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<LimitField, E> {
                if v == "unlimited" {
                    Ok(LimitField::Unlimited)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<LimitField, A::Error> {
                RateFields::deserialize(MapAccessDeserializer::new(map)).map(LimitField::Rates)
            }
        }
        deserializer.deserialize_any(LimitVisitor)
    }
}
