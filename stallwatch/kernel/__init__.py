"""The kernel's interfaces, read and parsed: /proc, /sys, diskstats and mountinfo, /dev/kmsg, the
syscall tables, NVML, and the file layer that crosses the job user's trust boundary (safefs).

The only code that knows where the kernel's files are (tests/test_layout.py checks):
    roots       where /proc, /sys and /dev/kmsg are (the host's, or a fixture tree), errno → Absent/Denied
    procfiles   ProcPaths, the /proc layout; ProcFiles, per-thread descriptors kept and pread
    proc        typed reads for everyone else: Proc(pid).stat(), .live_thread(), btime(), boot_id()
    procfs, diskfs, kmsgparse, syscalls_*    pure parsers: text in, frozen records out
    schedclock  each CPU's scheduler clock (se.exec_start) against /proc/uptime, measured there
    nvml        the one choke point of every NVML call
    safefs      no-follow opens under a directory the job's user owns

The lowest stage: it imports nothing else of stallwatch but the shared root modules. Kept
import-light: `python -m stallwatch.daemon.wrap` imports from here and must start fast.
"""
