//! The resident memory of a sluice process, read from /proc, and what each rule adds to it.

use std::time::Duration;

use super::steady;

/// The wrapper that tells sluice's allocator to return freed pages at once, so that its
/// resident memory counts only what it holds.
pub const FREED_PAGES_RETURNED: Option<&str> = Some("export MIMALLOC_PURGE_DELAY=0;");

/// The resident memory each of `rules` adds, in bytes: `resident_kb` (the resident memory of a
/// sluice given so many rules, in kB) for `rules` against `few` (1 or 0).
pub async fn bytes_per_rule(
    rules: usize,
    few: usize,
    resident_kb: impl AsyncFn(usize) -> u64,
) -> u64 {
    let grown = resident_kb(rules)
        .await
        .saturating_sub(resident_kb(few).await);
    grown * 1024 / rules as u64
}

/// The resident memory of sluice `pid` once settled, in kB: once it has not moved for half a
/// second, what loading freed has been given back (read for at most 10 s).
pub async fn settled_resident_kb(pid: u32) -> u64 {
    steady(Duration::from_millis(500), Duration::from_secs(10), || {
        memory_kb(pid, "VmRSS")
    })
    .await
}

/// Resets `pid`'s peak resident memory (`VmHWM`) to its resident memory now, so that a later
/// `VmHWM` tells the peak since.
pub fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("clear_refs");
}

/// A field of /proc/PID/status, in kB (`VmRSS`, `VmHWM`).
pub fn memory_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}
