//! What the benchmarks report with their figures: the median of runs,
//! and the machine they ran on.

/// The median of runs (the upper one of an even count).
pub fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// The machine a benchmark ran on: CPU model, CPUs, kernel.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cpu}, {} CPUs, Linux {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel.trim()
    )
}
