"""The kernel's interfaces, read and parsed: /proc, /sys, diskstats and mountinfo, /dev/kmsg, the
syscall tables, NVML, and the file layer that crosses the job user's trust boundary (safefs).

The lowest stage: it imports nothing else of stallwatch but the shared root modules. Kept
import-light: `python -m stallwatch.daemon.wrap` imports from here and must start fast.
"""
