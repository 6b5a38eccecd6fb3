//! What identifies a rule's buckets: a reload keeps the buckets (the
//! kernel's rule id) of a rule whose fingerprint did not change.

use super::{Limit, Rate, Rates, Rule};

impl Rule {
    /// Identifies what the rule's buckets mean (match, key, limits, but not
    /// name or action): a reload keeps the buckets of a rule whose
    /// fingerprint did not change. FNV-1a over a canonical text, so it is
    /// the same in every build.
    pub fn fingerprint(&self) -> u64 {
        let rate = |m: &Option<Rate>| {
            m.map_or("-".to_owned(), |m| {
                format!("{}/{}ns/{}", m.rate, m.period.as_nanos(), m.burst)
            })
        };
        let rates = |m: &Option<Rates>| {
            m.map_or("-".to_owned(), |m| {
                format!("{},{}", rate(&m.packets), rate(&m.bytes))
            })
        };
        let limit = match self.limit {
            Limit::Unlimited => "unlimited".to_owned(),
            Limit::Metered { packets, bytes } => rates(&Some(Rates { packets, bytes })),
        };
        let m = &self.matches;
        // A local rule's text is what it was before fleets existed, so an
        // upgrade keeps every bucket.
        let fleet = self.fleet.map_or(String::new(), |f| {
            format!("|fleet/{}/{}", f.partitions, f.reserve)
        });
        // Likewise a rule without layer-7 fields.
        let layer7 = if self.layer7_field().is_some() {
            format!("|l7/{:?}/{:?}", self.request, self.keyed_by)
        } else {
            String::new()
        };
        let text = format!(
            "{:?}|{}|{}|{}|{}/{}|{limit}|{}{fleet}{layer7}",
            self.algorithm,
            m.source.map_or("*".to_owned(), |s| s.to_string()),
            m.protocol.map_or("*".to_owned(), |p| p.to_string()),
            m.dest_port.map_or("*".to_owned(), |p| p.to_string()),
            self.key.v4,
            self.key.v6,
            rates(&self.aggregate),
        );
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}
