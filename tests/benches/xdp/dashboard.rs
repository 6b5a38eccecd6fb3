//! The dashboard's kernel panels drawn from a real run (`cargo xtask bench
//! -- dashboard`): the limiter under the bench's floods, its counters
//! sampled every half second (the same counters the daemon's `/metrics`
//! renders), the quantities of `dist/grafana/limiter.json`'s panels
//! computed from them and drawn with plotters as one PNG. Not a Grafana
//! screenshot: Debian has no Grafana package.

use std::{path::Path, thread, time::Duration, time::Instant};

use anyhow::{Result, anyhow};
use limiter::{lab::Lab, wire::Snapshot};
use limiter_tests::generator::{Generator, Sources};
use plotters::prelude::*;

use crate::receivers::{self, Installed, Limit, Peer};

/// What the run does, in turn: (what, sources, seconds).
const PHASES: [(&str, Sources, u64); 3] = [
    ("one source", Sources::Cycle(1), 6),
    ("forged sources", Sources::Random, 8),
    ("50,000 sources", Sources::Cycle(50_000), 6),
];

/// One sample: seconds since the start, the counters, the keys held.
struct Sample {
    t: f64,
    snapshot: Snapshot,
    keys: usize,
}

pub fn render(lab: &Lab, generator: &mut Generator, png: &Path) -> Result<()> {
    let installed = receivers::install(lab, Peer::Limiter, receivers::CAPACITY, Limit::Peers)?;
    let Installed::Limiter(session) = &installed else {
        anyhow::bail!("the limiter peer is a session");
    };
    let start = Instant::now();
    let mut samples = Vec::new();
    let sample = |samples: &mut Vec<Sample>| -> Result<()> {
        samples.push(Sample {
            t: start.elapsed().as_secs_f64(),
            snapshot: session.snapshot()?,
            keys: session.engine().datapath().maps().keys.count(),
        });
        Ok(())
    };
    sample(&mut samples)?;
    for (what, sources, seconds) in PHASES {
        println!("   {what} for {seconds} s");
        thread::scope(|scope| -> Result<()> {
            let flooding =
                scope.spawn(|| generator.flood(lab, sources, Duration::from_secs(seconds)));
            while !flooding.is_finished() {
                thread::sleep(Duration::from_millis(500));
                sample(&mut samples)?;
            }
            flooding.join().map_err(|_| anyhow!("flood thread"))??;
            Ok(())
        })?;
    }
    let capacity = session.engine().datapath().maps().keys.capacity() as f64;
    receivers::remove(lab, installed)?;
    draw(png, &samples, capacity)
}

/// Per second between two samples, of a counter read from a snapshot.
fn rates(samples: &[Sample], counter: impl Fn(&Snapshot) -> u64) -> Vec<(f64, f64)> {
    samples
        .windows(2)
        .map(|w| {
            let dt = (w[1].t - w[0].t).max(1e-3);
            let d = counter(&w[1].snapshot).saturating_sub(counter(&w[0].snapshot));
            (w[1].t, d as f64 / dt)
        })
        .collect()
}

fn rule_counter(
    name: &'static str,
    counter: impl Fn(&limiter_common::abi::RuleCounters) -> u64,
) -> impl Fn(&Snapshot) -> u64 {
    move |s| {
        s.rules
            .iter()
            .filter(|r| r.name == name)
            .map(|r| counter(&r.counters))
            .sum()
    }
}

/// A panel: its title, its unit, and its named series.
type Panel = (
    &'static str,
    &'static str,
    Vec<(&'static str, Vec<(f64, f64)>)>,
);

fn draw(png: &Path, samples: &[Sample], capacity: f64) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", png.display());
    let root = BitMapBackend::new(png, (1500, 950)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(
            "limiter: the dashboard's kernel panels, from the bench's floods (one source, forged, 50,000 sources)",
            ("sans-serif", 22),
        )
        .map_err(|e| err(&e))?;
    let areas = root.split_evenly((2, 3));
    let mpps = |v: Vec<(f64, f64)>| v.into_iter().map(|(t, r)| (t, r / 1e6)).collect();
    let panels: [Panel; 6] = [
        (
            "Dropped packets, rule bench",
            "Mpps",
            vec![(
                "dropped",
                mpps(rates(samples, rule_counter("bench", |c| c.dropped_packets))),
            )],
        ),
        (
            "Passed packets, rule bench",
            "Mpps",
            vec![(
                "passed",
                mpps(rates(samples, rule_counter("bench", |c| c.passed_packets))),
            )],
        ),
        (
            "Key table occupancy",
            "% of capacity",
            vec![(
                "keys held",
                samples
                    .iter()
                    .map(|s| (s.t, 100.0 * s.keys as f64 / capacity))
                    .collect(),
            )],
        ),
        (
            "New keys and unadmitted packets",
            "per second",
            vec![
                (
                    "new keys",
                    rates(samples, rule_counter("bench", |c| c.new_keys)),
                ),
                (
                    "unadmitted",
                    rates(samples, rule_counter("bench", |c| c.unadmitted)),
                ),
            ],
        ),
        (
            "Key evictions and refusals",
            "per second",
            vec![
                ("evicted", rates(samples, |s| s.global.key_evictions)),
                (
                    "refused a slot",
                    rates(samples, |s| s.global.key_alloc_failed),
                ),
            ],
        ),
        (
            "Parse failures and blocked",
            "per second",
            vec![
                ("malformed", rates(samples, |s| s.global.malformed)),
                ("blocked", rates(samples, |s| s.global.blocked)),
            ],
        ),
    ];
    let colors = [RGBColor(0xd6, 0x27, 0x28), RGBColor(0x1f, 0x77, 0xb4)];
    for (area, (title, unit, series)) in areas.iter().zip(panels) {
        let t_max = samples.last().map_or(1.0, |s| s.t);
        let y_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
            .fold(0.0, f64::max)
            .max(if unit == "Mpps" { 0.1 } else { 1.0 })
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(unit)
            .y_label_formatter(&|v| match *v {
                v if v >= 1e6 => format!("{:.1}M", v / 1e6),
                v if v >= 1e4 => format!("{:.0}k", v / 1e3),
                v if v >= 10.0 => format!("{v:.0}"),
                v => format!("{v:.1}"),
            })
            .draw()
            .map_err(|e| err(&e))?;
        for (i, (name, points)) in series.into_iter().enumerate() {
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
