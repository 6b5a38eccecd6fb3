//! What identifies a rule's buckets: a reload keeps the buckets (the
//! kernel's rule id) of a rule whose fingerprint did not change, and the
//! keys of one whose identity (its keys without its limits) did not.

use super::{Algorithm, Limit, Rate, Rates, Rule};

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
        // A local rule's text is what it was before fleets existed, so an
        // upgrade keeps every bucket.
        let fleet = self.fleet.map_or(String::new(), |f| {
            format!("|fleet/{}/{}", f.partitions, f.reserve)
        });
        // Likewise a rule without a soft limit.
        let fleet = match &self.soft {
            Some(_) => format!("{fleet}|soft/{}", rate(&self.soft)),
            None => fleet,
        };
        // And without a second packet limit.
        let fleet = match &self.second_packets {
            Some(_) => format!("{fleet}|second/{}", rate(&self.second_packets)),
            None => fleet,
        };
        // And without a third limit.
        let fleet = match &self.third {
            Some(t) => format!("{fleet}|third/{}/{}", rate(&Some(t.rate)), t.counts_bytes),
            None => fleet,
        };
        // And without costs: a credit means something else than a packet.
        let fleet = if self.costs.is_empty() {
            fleet
        } else {
            format!("{fleet}|cost/{:?}", self.costs)
        };
        let text = format!(
            "{}|{limit}|{}{fleet}{}",
            self.keys_text(),
            rates(&self.aggregate),
            self.layer7_text(),
        );
        fnv1a(&text)
    }

    /// Identifies what the rule's keys are (algorithm, match and key, not
    /// limits, name or action): a rule whose fingerprint changed but whose
    /// identity did not keeps its id and its keys, their state carried
    /// over to the new limits (`Gcra::carried`). Never 0, which is what a
    /// rule written by a build that kept no identity holds.
    pub fn identity(&self) -> u32 {
        // A window's counts are per window: a rule whose unit changed
        // counts in windows of another length, so its keys start afresh.
        let unit = match (self.algorithm, self.limit) {
            (Algorithm::Gcra, _) | (_, Limit::Unlimited) => String::new(),
            (_, Limit::Metered { packets, bytes }) => packets
                .or(bytes)
                .map_or(String::new(), |r| format!("|unit/{}", r.period.as_nanos())),
        };
        // The key's second meter counts packets (a second packet limit) or
        // bytes: a rule switching them starts its keys afresh.
        let second = if self.second_packets.is_some() {
            "|second-counts-packets"
        } else {
            ""
        };
        // Likewise the third word: a soft limit's, or a third limit's in
        // packets or in bytes (nothing added for the first two, so the
        // identities of rules without a third limit are what they were).
        let third = match self.third {
            Some(t) if t.counts_bytes => "|third-counts-bytes",
            Some(_) => "|third-counts-packets",
            None => "",
        };
        let text = format!(
            "identity|{}{}{unit}{second}{third}",
            self.keys_text(),
            self.layer7_text()
        );
        let hash = fnv1a(&text);
        ((hash >> 32) as u32 ^ hash as u32) | 1
    }

    /// The algorithm, the match and the key, as both texts write them.
    fn keys_text(&self) -> String {
        let m = &self.matches;
        // Nothing for a rule without TCP flags: its text is what it was.
        let tcp = m
            .tcp_flags
            .map_or(String::new(), |f| format!("|tcp/{}/{}", f.mask, f.value));
        format!(
            "{:?}|{}|{}|{}|{}/{}{tcp}",
            self.algorithm,
            m.source.map_or("*".to_owned(), |s| s.to_string()),
            m.protocol.map_or("*".to_owned(), |p| p.to_string()),
            m.dest_port.map_or("*".to_owned(), |p| p.to_string()),
            self.key.v4,
            self.key.v6,
        )
    }

    /// The layer-7 match and key; nothing for a rule without them, so its
    /// text is what it was before layer 7 existed.
    fn layer7_text(&self) -> String {
        if self.layer7_field().is_some() {
            format!("|l7/{:?}/{:?}", self.request, self.keyed_by)
        } else {
            String::new()
        }
    }
}

/// FNV-1a of `text`: the same in every build.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
