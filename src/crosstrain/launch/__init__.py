"""The framework-free subprocess launcher every subprocess backend shares (tf, the jax
example, a third party's): process groups, parent-death signal, SIGINT/SIGTERM, error
files and the heartbeat monitor. It imports core only; backends import it."""

from crosstrain.launch.monitor import StallMonitor
from crosstrain.launch.outcomes import error_summary
from crosstrain.launch.process import die_with_parent, interrupts_raise, stop_processes
from crosstrain.launch.supervisor import WorkerSpec, launch_folder, run_workers, supervise
from crosstrain.launch.worker import serve

__all__ = [
    "StallMonitor",
    "WorkerSpec",
    "die_with_parent",
    "error_summary",
    "interrupts_raise",
    "launch_folder",
    "run_workers",
    "serve",
    "stop_processes",
    "supervise",
]
