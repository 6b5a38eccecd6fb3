//! Fields written as text: address prefixes, units of time, a key's
//! prefix length (`source/N`), TCP flags (`syn,!ack`).

use std::{net::IpAddr, time::Duration};

use ipnet::IpNet;

use crate::rules::invalid::{InvalidField, invalid};
use crate::{
    rules::set::{KeyPrefix, TcpFlags},
    yaml::quoted,
};

pub(super) fn parse_prefix(text: &str) -> Result<IpNet, InvalidField> {
    parse_net(text).map_err(|message| invalid("match.source", message))
}

/// A field written as text that says nothing it could mean.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadText {
    #[error("{} is not an address prefix such as 10.0.0.0/8 or 2001:db8::/32", quoted(.0))]
    NotAPrefix(String),
    #[error(
        "{}: expected second, minute, hour, day or a duration like 30s ({reason})",
        quoted(.text)
    )]
    NotAUnit { text: String, reason: String },
    #[error("must be longer than zero")]
    ZeroUnit,
}

/// An address prefix (`10.0.0.0/8`), or a single address (`/32`, `/128`).
pub fn parse_net(text: &str) -> Result<IpNet, BadText> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| BadText::NotAPrefix(text.to_owned()))
}

/// `second`, `minute`, `hour`, `day`, or a duration such as `30s` or `250ms`.
pub fn parse_unit(unit: &str) -> Result<Duration, BadText> {
    let period = match unit {
        "second" => Duration::from_secs(1),
        "minute" => Duration::from_secs(60),
        "hour" => Duration::from_secs(3600),
        "day" => Duration::from_secs(86_400),
        other => humantime::parse_duration(other).map_err(|e| BadText::NotAUnit {
            text: other.to_owned(),
            reason: e.to_string(),
        })?,
    };
    if period.is_zero() {
        return Err(BadText::ZeroUnit);
    }
    Ok(period)
}

/// `source` (whole address), `source/N`, or absent (the default: /32 for
/// IPv4, /64 for IPv6).
pub(super) fn parse_key(key: Option<&str>, source: Option<IpNet>) -> Result<KeyPrefix, String> {
    let Some(key) = key else {
        return Ok(KeyPrefix::DEFAULT);
    };
    if key == "source" {
        return Ok(KeyPrefix { v4: 32, v6: 128 });
    }
    let bits = key
        .strip_prefix("source/")
        .and_then(|n| n.parse::<u8>().ok())
        .ok_or_else(|| format!("{}: expected `source` or `source/N`", quoted(key)))?;
    if bits == 0 {
        return Err(
            "source/0 makes one bucket of every source: write `key: all` if that is meant".into(),
        );
    }
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

/// `syn`, `syn,!ack`, `rst`: each flag named is set, or with `!` clear.
pub(super) fn tcp_flags(text: &str) -> Result<TcpFlags, String> {
    let mut flags = TcpFlags::default();
    for part in text.split(',').map(str::trim) {
        let (clear, name) = match part.strip_prefix('!') {
            Some(name) => (true, name.trim()),
            None => (false, part),
        };
        let bit = TcpFlags::NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                format!(
                    "{}: {name:?} is not a TCP flag (one of {}, each maybe with `!`, comma-separated)",
                    quoted(text),
                    TcpFlags::NAMES.join(", ")
                )
            })?;
        if flags.mask & (1 << bit) != 0 {
            return Err(format!("{}: {name} named twice", quoted(text)));
        }
        flags.mask |= 1 << bit;
        if !clear {
            flags.value |= 1 << bit;
        }
    }
    Ok(flags)
}
