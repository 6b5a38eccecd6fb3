//! A rule's rates: each `rate`/`bytes` with its unit and burst made a
//! meter, a key's window counts bounded, `limits: [...]` placed in a key's
//! three meters, and a `soft` limit below the hard one.

use limiter_common::{gcra::Gcra, keytable::MAX_WINDOW_LIMIT, window::Window};

use super::{fleet::local_only, text::parse_unit};
use crate::rules::invalid::{InvalidField, invalid};
use crate::rules::{
    raw::{self, Algorithm},
    set::{Limit, Rate, Rates, ThirdLimit},
};

pub(super) fn validate_rates(
    rates: &raw::RateFields,
    algorithm: Algorithm,
) -> Result<Rates, InvalidField> {
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
        Ok(Some(Rate {
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
    Ok(Rates { packets, bytes })
}

/// A key's window counts are 31-bit (`keytable::MAX_WINDOW_LIMIT`: 60
/// bytes a key); a rule's aggregate has no such bound.
pub(super) fn key_window_fits(rates: &Rates) -> Result<(), InvalidField> {
    for (field, rate) in [("rate", &rates.packets), ("bytes", &rates.bytes)] {
        if let Some(rate) = rate
            && rate.window.length_ns != 0
            && rate.rate > MAX_WINDOW_LIMIT
        {
            return Err(invalid(
                field,
                format!(
                    "{}: a window counts at most {} per key; use a shorter unit, or gcra",
                    rate.rate, MAX_WINDOW_LIMIT
                ),
            ));
        }
    }
    Ok(())
}

/// What `limits: [...]` asks of a key's meters.
pub(super) struct SeveralLimits {
    pub(super) limit: Limit,
    pub(super) second_packets: Option<Rate>,
    pub(super) third: Option<ThirdLimit>,
}

/// `limits: [...]`: every packet must pass them all, kept shortest unit
/// first (the first is the one `RateLimit-Policy` names). Three at most, as a
/// key's state holds three meters: the first packet rate in the packet
/// meter, the first byte rate (or else the second packet rate) in the
/// byte meter, any third in the state's third word (GCRA only: a window
/// key's state is full with two). No pacing (`delay`) and no fleet fields.
pub(super) fn several_limits(
    list: &[raw::RateFields],
    algorithm: Algorithm,
) -> Result<SeveralLimits, InvalidField> {
    let mut packets: Vec<Rate> = Vec::new();
    let mut bytes: Vec<Rate> = Vec::new();
    for (i, fields) in list.iter().enumerate() {
        let at = |f: &str| format!("limits[{i}].{f}");
        if fields.delay.is_some() {
            return Err(invalid(
                at("delay"),
                "pacing takes one `limit`, not `limits`",
            ));
        }
        local_only(fields).map_err(|e| e.within(at))?;
        let m = validate_rates(fields, algorithm).map_err(|e| e.within(at))?;
        key_window_fits(&m).map_err(|e| e.within(at))?;
        packets.extend(m.packets);
        bytes.extend(m.bytes);
    }
    // Shortest unit first, whatever the file's order: each limit keeps
    // its meter word when the list is reordered (a limit change carries
    // each word's state over to the limit now in it).
    for rates in [&mut packets, &mut bytes] {
        rates.sort_by_key(|r| (r.period, r.rate, r.burst));
    }
    let count = packets.len() + bytes.len();
    if list.is_empty() || count > 3 || bytes.len() > 2 {
        return Err(invalid(
            "limits",
            "one to three limits per key, two byte rates at most: a key's state holds three meters",
        ));
    }
    if algorithm != Algorithm::Gcra && (count > 2 || bytes.len() > 1) {
        return Err(invalid(
            "limits",
            "a window key holds two meters (two packet rates, or a packet and a byte rate); three limits need algorithm gcra",
        ));
    }
    // A window key keeps one window start for its two meters.
    let units: Vec<std::time::Duration> = packets.iter().chain(&bytes).map(|r| r.period).collect();
    if algorithm != Algorithm::Gcra && units.windows(2).any(|w| w[0] != w[1]) {
        return Err(invalid(
            "limits",
            "limits of different units need algorithm gcra (a window key keeps one window start for both)",
        ));
    }
    // The byte meter holds the first byte rate, else the second packet
    // rate; the third word whatever is left.
    let second_packets = if bytes.is_empty() {
        packets.get(1).copied()
    } else {
        None
    };
    let placed = usize::from(!packets.is_empty())
        + usize::from(!bytes.is_empty() || second_packets.is_some());
    let third = (count > placed).then(|| match bytes.get(1) {
        Some(&rate) => ThirdLimit {
            rate,
            counts_bytes: true,
        },
        None => ThirdLimit {
            rate: *packets.last().expect("a third limit"),
            counts_bytes: false,
        },
    });
    Ok(SeveralLimits {
        limit: Limit::Metered {
            packets: packets.first().copied(),
            bytes: bytes.first().copied(),
        },
        second_packets,
        third,
    })
}

/// A `soft` limit: a packet rate, on a GCRA rule, below a hard packet
/// limit (at most its rate and its burst, and not both the same); with
/// two, below either (`second`: the second).
pub(super) fn soft_limit(
    fields: &raw::RateFields,
    limit: &Limit,
    second: Option<&Rate>,
    algorithm: Algorithm,
) -> Result<Rate, InvalidField> {
    if algorithm != Algorithm::Gcra {
        return Err(invalid(
            "soft",
            "needs algorithm gcra (a window key's state has no room for a third meter)",
        ));
    }
    let Limit::Metered {
        packets: Some(hard),
        ..
    } = limit
    else {
        return Err(invalid(
            "soft",
            "needs a hard packet limit to be below: `limit: { rate: ... }`",
        ));
    };
    let stray = [
        ("bytes", fields.bytes.is_some()),
        ("burst_bytes", fields.burst_bytes.is_some()),
        ("delay", fields.delay.is_some()),
    ];
    if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
        return Err(invalid(
            format!("soft.{field}"),
            "a soft limit is a packet (request) rate: `rate`, `unit` and `burst`",
        ));
    }
    local_only(fields).map_err(|e| e.within(|f| format!("soft.{f}")))?;
    let rates = validate_rates(fields, algorithm).map_err(|e| e.within(|f| format!("soft.{f}")))?;
    let soft = rates
        .packets
        .ok_or_else(|| invalid("soft.rate", "a soft limit needs `rate`"))?;
    // A longer emission interval is a lower rate.
    let below = |hard: &Rate| {
        soft.gcra.emission_ns >= hard.gcra.emission_ns
            && soft.burst <= hard.burst
            && (soft.gcra.emission_ns, soft.burst) != (hard.gcra.emission_ns, hard.burst)
    };
    if !below(hard) && !second.is_some_and(below) {
        return Err(invalid(
            "soft",
            format!(
                "{} per {} with a burst of {} is not below the hard limit ({} per {}, burst {})",
                soft.rate,
                humantime::format_duration(soft.period),
                soft.burst,
                hard.rate,
                humantime::format_duration(hard.period),
                hard.burst
            ),
        ));
    }
    Ok(soft)
}
