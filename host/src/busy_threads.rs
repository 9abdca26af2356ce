//! Keeps threads of this process that busy-wait off the physical core of
//! the thread that evaluates the model (Linux, CUDA backend).
//!
//! Why: MLX 0.32's CUDA backend runs completion handlers on a worker thread
//! (`cu::Worker::thread_fn`, `mlx/backend/cuda/worker.cpp`) whose loop
//! declares its batch counter inside the loop, so once the first batch was
//! signalled its condition-variable wait never blocks again: the thread
//! spins at 100% of a CPU for the life of the process (it takes the name of
//! the thread that first used the GPU, here `engine`). Wherever the kernel
//! scheduler puts it on the evaluating thread's core (its SMT sibling, or
//! the same CPU), the host work of a step (graph building and MLX's kernel
//! encoding, which bound a small model's step on a GPU) runs at a fraction
//! of its speed: with the whole server on one CPU of an H200 machine, a
//! SmolLM2 one-row step over HTTP took ~11 ms against 2.5-4.9 ms unpinned
//! (docs/benchmarks.md, "Run 10").
//!
//! What this does, once per process, after the first evaluations (`serve`'s
//! warm-up, `generate`'s load, before `bench`'s decode loop): finds the
//! threads with the caller's name (MLX's worker inherits it) that stay busy
//! while the caller sleeps (100 ms), pins them to the CPU they run on, and
//! keeps the calling thread off that CPU's physical core. Nothing else
//! changes (same kernels, same outputs). Skipped when the process may use
//! only one physical core, on other backends and systems, and with
//! `MLXHOST_ISOLATE_BUSY_THREADS=off`.
//!
//! Measured (docs/benchmarks.md, "Run 11"): sharing a CPU with the worker
//! doubles the step (8.0 ms against 2.7-4.4 on an H100); anywhere else no
//! placement wins beyond the machine's drift, and this isolation on against
//! off, side by side on an H200, was 0.995x. It guards the shared-CPU case
//! only; the ~11 ms with the whole server on one CPU it cannot help (no
//! other core).

use std::sync::Once;
use std::time::Duration;

/// How long the caller sleeps while busy threads are measured.
const WINDOW: Duration = Duration::from_millis(100);
/// A thread counts as busy when it ran for at least this share of the
/// window while the caller slept.
const BUSY_SHARE: f64 = 0.7;

/// Isolates busy threads from the calling thread (see the module doc), at
/// most once per process. Logs what it did at info level; failures are
/// logged and otherwise ignored (this is a placement hint, not a need).
pub fn isolate_from_caller_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mode = std::env::var("MLXHOST_ISOLATE_BUSY_THREADS");
        if mode.as_deref() == Ok("off") || crate::runtime::backend_name() != "cuda" {
            return;
        }
        imp::isolate(mode.as_deref() == Ok("pin"));
    });
}

#[cfg(target_os = "linux")]
mod imp {
    use super::{BUSY_SHARE, WINDOW};
    use std::collections::BTreeSet;

    /// With `pin_caller`, the calling thread is then pinned to one CPU of
    /// the rest (the lowest one local to the GPU's NUMA node where sysfs
    /// names one), so it no longer moves between CPUs from one request to
    /// the next.
    pub fn isolate(pin_caller: bool) {
        // SAFETY: a plain system call.
        let own = unsafe { libc::gettid() };
        let allowed = match affinity(0) {
            Ok(cpus) => cpus,
            Err(e) => return tracing::debug!(error = %e, "busy threads: no affinity mask"),
        };
        // MLX's worker is started by the thread that first used the GPU and
        // inherits its name; other busy threads (a plugin compile) are not
        // ours to move.
        let own_name = thread_name(own);
        let busy: Vec<libc::pid_t> = match busy_threads(own, BUSY_SHARE) {
            Ok(b) => b
                .into_iter()
                .filter(|&t| own_name.is_some() && thread_name(t) == own_name)
                .collect(),
            Err(e) => return tracing::debug!(error = %e, "busy threads: cannot read /proc"),
        };
        if busy.is_empty() {
            return tracing::info!("busy threads: none found beside the evaluating thread");
        }
        // The CPU the first busy thread runs on now (so several processes'
        // spinners stay where the kernel spread them), else the last allowed.
        let spin_cpu = last_cpu(busy[0])
            .filter(|c| allowed.contains(c))
            .or_else(|| allowed.iter().next_back().copied());
        let Some(spin_cpu) = spin_cpu else {
            return;
        };
        let core = siblings(spin_cpu).unwrap_or_else(|| BTreeSet::from([spin_cpu]));
        let rest: BTreeSet<usize> = allowed.difference(&core).copied().collect();
        if rest.is_empty() {
            return tracing::debug!(
                cpus = allowed.len(),
                "busy threads: no core left to move to"
            );
        }
        let pinned: Vec<libc::pid_t> = busy
            .iter()
            .copied()
            .filter(
                |&tid| match set_affinity(tid, &BTreeSet::from([spin_cpu])) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(tid, error = %e, "busy threads: could not pin");
                        false
                    }
                },
            )
            .collect();
        if pinned.is_empty() {
            return;
        }
        let caller_cpus = if pin_caller {
            one_cpu(&rest, &gpu_local_cpus().unwrap_or_default())
        } else {
            rest
        };
        match set_affinity(0, &caller_cpus) {
            Ok(()) => tracing::info!(
                pinned = ?pinned,
                pinned_to_cpu = spin_cpu,
                evaluating_thread_cpus = ?caller_cpus,
                "threads that busy-wait (MLX's CUDA completion worker) pinned off the evaluating thread's core"
            ),
            Err(e) => tracing::warn!(error = %e, "busy threads: could not move the caller"),
        }
    }

    /// `/proc/self/task/<tid>/comm`, the thread's name.
    fn thread_name(tid: libc::pid_t) -> Option<String> {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// The CPU thread `tid` last ran on (field 39 of its `stat`; the name
    /// field may hold spaces, so fields are counted after its closing `)`).
    fn last_cpu(tid: libc::pid_t) -> Option<usize> {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
        let after_name = &stat[stat.rfind(')')? + 1..];
        // Field 3 (state) is the first after the name; field 39 is 36 later.
        after_name.split_whitespace().nth(36)?.parse().ok()
    }

    /// Threads of this process other than `own` that ran for at least
    /// `share` of [`WINDOW`] while the caller slept, by their CPU time in
    /// `/proc/self/task/<tid>/schedstat` (ns).
    pub fn busy_threads(own: libc::pid_t, share: f64) -> std::io::Result<Vec<libc::pid_t>> {
        let before = cpu_times()?;
        std::thread::sleep(WINDOW);
        let after = cpu_times()?;
        let window_ns = WINDOW.as_nanos() as f64;
        Ok(after
            .into_iter()
            .filter(|(tid, _)| *tid != own)
            .filter_map(|(tid, t)| {
                let (_, t0) = before.iter().find(|(b, _)| *b == tid)?;
                ((t.saturating_sub(*t0)) as f64 >= share * window_ns).then_some(tid)
            })
            .collect())
    }

    fn cpu_times() -> std::io::Result<Vec<(libc::pid_t, u64)>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/proc/self/task")? {
            let entry = entry?;
            let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            // A thread may end between the listing and the read.
            let Ok(stat) = std::fs::read_to_string(entry.path().join("schedstat")) else {
                continue;
            };
            if let Some(ns) = stat.split_whitespace().next().and_then(|s| s.parse().ok()) {
                out.push((tid, ns));
            }
        }
        Ok(out)
    }

    /// The CPUs thread `tid` (0: the caller) may run on.
    fn affinity(tid: libc::pid_t) -> std::io::Result<BTreeSet<usize>> {
        // SAFETY: `set` is a plain bit set the call fills; its size is passed.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok((0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect())
        }
    }

    fn set_affinity(tid: libc::pid_t, cpus: &BTreeSet<usize>) -> std::io::Result<()> {
        // SAFETY: as in `affinity`; every index is below CPU_SETSIZE (it came
        // from a mask of that size).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus {
                libc::CPU_SET(c, &mut set);
            }
            if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// The CPUs sharing `cpu`'s physical core (itself included), from
    /// sysfs's `thread_siblings_list` ("3,11" or "2-3").
    fn siblings(cpu: usize) -> Option<BTreeSet<usize>> {
        let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
        parse_cpu_list(std::fs::read_to_string(path).ok()?.trim())
    }

    /// One CPU of `rest` for the evaluating thread: the lowest that is also
    /// in `local` (the GPU's NUMA node), else the lowest of `rest`; empty
    /// when `rest` is.
    pub fn one_cpu(rest: &BTreeSet<usize>, local: &BTreeSet<usize>) -> BTreeSet<usize> {
        rest.intersection(local)
            .next()
            .or_else(|| rest.iter().next())
            .map(|&c| BTreeSet::from([c]))
            .unwrap_or_default()
    }

    /// The CPUs local to the first NVIDIA GPU's NUMA node, from sysfs
    /// (`/sys/bus/pci/devices/*/local_cpulist` of the lowest PCI address
    /// with vendor 0x10de and a display class, 0x03xxxx); `None` when there
    /// is none or sysfs does not say.
    fn gpu_local_cpus() -> Option<BTreeSet<usize>> {
        let mut devices: Vec<_> = std::fs::read_dir("/sys/bus/pci/devices")
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
                read("vendor").trim() == "0x10de" && read("class").trim().starts_with("0x03")
            })
            .collect();
        devices.sort();
        let list = std::fs::read_to_string(devices.first()?.join("local_cpulist")).ok()?;
        parse_cpu_list(list.trim())
    }

    /// Parses a kernel CPU list ("0-3,8,10-11").
    pub fn parse_cpu_list(list: &str) -> Option<BTreeSet<usize>> {
        let mut out = BTreeSet::new();
        for part in list.split(',').filter(|p| !p.is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => out.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
                None => {
                    out.insert(part.parse().ok()?);
                }
            }
        }
        (!out.is_empty()).then_some(out)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn cpu_lists_parse_as_the_kernel_writes_them() {
            assert_eq!(parse_cpu_list("3,11"), Some(BTreeSet::from([3, 11])));
            assert_eq!(parse_cpu_list("0-2,8"), Some(BTreeSet::from([0, 1, 2, 8])));
            assert_eq!(parse_cpu_list("5"), Some(BTreeSet::from([5])));
            assert_eq!(parse_cpu_list(""), None);
            assert_eq!(parse_cpu_list("x"), None);
        }

        #[test]
        fn the_pinned_cpu_is_the_lowest_gpu_local_one_left() {
            let rest = BTreeSet::from([1, 2, 9, 10]);
            assert_eq!(
                one_cpu(&rest, &BTreeSet::from([8, 9, 10])),
                BTreeSet::from([9])
            );
            // No NUMA information, or none of it left: the lowest left.
            assert_eq!(one_cpu(&rest, &BTreeSet::new()), BTreeSet::from([1]));
            assert_eq!(one_cpu(&rest, &BTreeSet::from([4])), BTreeSet::from([1]));
        }

        #[test]
        fn a_threads_name_and_cpu_are_read_from_proc() {
            // SAFETY: a plain system call.
            let own = unsafe { libc::gettid() };
            let cpu = last_cpu(own).expect("stat field 39");
            assert!(affinity(0).expect("mask").contains(&cpu), "cpu {cpu}");
            assert!(thread_name(own).is_some_and(|n| !n.is_empty()));
        }

        #[test]
        fn a_spinning_thread_is_found_and_a_sleeping_one_is_not() {
            use std::sync::atomic::{AtomicBool, Ordering};
            use std::sync::Arc;
            let stop = Arc::new(AtomicBool::new(false));
            let tid_of = |spin: bool, stop: Arc<AtomicBool>| {
                let (tx, rx) = std::sync::mpsc::channel();
                let h = std::thread::spawn(move || {
                    // SAFETY: a plain system call.
                    tx.send(unsafe { libc::gettid() }).ok();
                    while !stop.load(Ordering::Relaxed) {
                        if !spin {
                            std::thread::sleep(std::time::Duration::from_millis(5));
                        }
                        std::hint::spin_loop();
                    }
                });
                (rx.recv().expect("tid"), h)
            };
            let (spinner, h1) = tid_of(true, stop.clone());
            let (sleeper, h2) = tid_of(false, stop.clone());
            // A low bar and a few windows: CI's two cores may be shared with
            // other tests; the sleeper runs well under 1% of a window.
            // SAFETY: a plain system call.
            let own = unsafe { libc::gettid() };
            let mut busy = Vec::new();
            for _ in 0..5 {
                busy = busy_threads(own, 0.1).expect("read /proc");
                if busy.contains(&spinner) {
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            h1.join().ok();
            h2.join().ok();
            assert!(
                busy.contains(&spinner),
                "{busy:?} lacks the spinner {spinner}"
            );
            assert!(
                !busy.contains(&sleeper),
                "{busy:?} holds the sleeper {sleeper}"
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub fn isolate(_pin_caller: bool) {}
}
