//! The fields of a fleet-wide budget (`scope`, `partitions`, `reserve`):
//! on an aggregate only, and each node's share a valid meter.

use limiter_common::gcra::Gcra;

use crate::rules::invalid::{InvalidField, invalid};
use crate::rules::{
    raw,
    set::{FleetShare, Rates},
};

/// `scope`, `partitions` and `reserve` belong to an aggregate.
pub(super) fn local_only(fields: &raw::RateFields) -> Result<(), InvalidField> {
    let given = [
        ("scope", fields.scope.is_some()),
        ("partitions", fields.partitions.is_some()),
        ("reserve", fields.reserve.is_some()),
    ];
    match given.iter().find(|(_, set)| *set) {
        Some((field, _)) => Err(invalid(
            *field,
            "applies to `aggregate` only: a fleet shares the rule's one budget, not each key's",
        )),
        None => Ok(()),
    }
}

/// The most partitions a fleet budget may have: one key each in the store,
/// renewed together.
pub const MAX_PARTITIONS: u32 = 1000;

/// An aggregate's `scope: fleet` and how it is shared.
pub(super) fn fleet_share(
    fields: &raw::RateFields,
    rates: &Rates,
) -> Result<Option<FleetShare>, InvalidField> {
    if fields.scope != Some(raw::Scope::Fleet) {
        let stray = [
            ("partitions", fields.partitions.is_some()),
            ("reserve", fields.reserve.is_some()),
        ];
        if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
            return Err(invalid(*field, "needs `scope: fleet`"));
        }
        return Ok(None);
    }
    let Some(packets) = rates.packets else {
        return Err(invalid(
            "scope",
            "a fleet budget is in packets (requests): give `rate`",
        ));
    };
    if packets.window.length_ns != 0 {
        return Err(invalid(
            "scope",
            "a fleet budget needs algorithm gcra: a window's count cannot move between hosts \
             with the partitions, so a partition moved within a window would count twice",
        ));
    }
    if rates.bytes.is_some() {
        return Err(invalid(
            "bytes",
            "a fleet budget is in packets (requests) only; limit bytes in a rule of its own",
        ));
    }
    let partitions = fields.partitions.unwrap_or(packets.rate.min(50) as u32);
    if partitions == 0 || partitions > MAX_PARTITIONS || u64::from(partitions) > packets.rate {
        return Err(invalid(
            "partitions",
            format!(
                "{partitions}: must be 1 to {} (at most {MAX_PARTITIONS}, and each worth at least 1 per unit)",
                packets.rate.min(u64::from(MAX_PARTITIONS))
            ),
        ));
    }
    let reserve = fields.reserve.unwrap_or(0);
    if reserve > packets.rate {
        return Err(invalid(
            "reserve",
            format!(
                "{reserve} per unit is more than the fleet's whole rate ({})",
                packets.rate
            ),
        ));
    }
    // A node's share goes up to reserve + rate: it must be a valid meter.
    let most = packets.rate + reserve;
    let period_ns = u64::try_from(packets.period.as_nanos()).unwrap_or(u64::MAX);
    // (A GCRA meter: a window's budget was refused above.)
    Gcra::new(most, period_ns, packets.burst).map_err(|e| invalid("reserve", e.to_string()))?;
    Ok(Some(FleetShare {
        partitions,
        reserve,
    }))
}
