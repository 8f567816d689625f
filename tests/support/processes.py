"""The processes of a run and the sockets they listen on, found by its session, process tree and Ray
session folder (not by timing): what tests/e2e/test_listening.py and test_ray_job.py check."""

from __future__ import annotations

import ipaddress
import os
import re
import socket

SESSION_DIR = re.compile(r"/session_\d{4}-\d\d-\d\d_[\w.-]+?_\d+(?=/|\s|$)")


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address (::ffff:127.0.0.1, how gRPC's
    dual-stack sockets show a 127.0.0.1 bind)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def run_processes(root: int) -> dict[int, str]:
    """pid -> command line of every process of the run whose driver is `root` (started in its own
    session): the processes of that session, the descendants of `root`, those whose command line
    names the run's Ray session folder, and their descendants. Processes that exit while the table
    is read are skipped."""
    import psutil

    table: dict[int, tuple[int, str]] = {}
    for p in psutil.process_iter(["ppid", "cmdline"]):
        try:
            table[p.pid] = (p.info["ppid"], " ".join(p.info["cmdline"] or []))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    run = {root}
    for pid in table:
        try:
            if os.getsid(pid) == root:
                run.add(pid)
        except OSError:
            continue
    sessions = {m.group(0) for pid in run if pid in table for m in SESSION_DIR.finditer(table[pid][1])}
    run |= {pid for pid, (_, cmd) in table.items() if any(s in cmd for s in sessions)}
    while more := {pid for pid, (ppid, _) in table.items() if ppid in run} - run:
        run |= more
    return {pid: table[pid][1] for pid in run if pid in table}


def listeners(pids: set[int]) -> list[tuple[int, str, int, str]]:
    """(pid, ip, port, kind) of each TCP socket in LISTEN and each unconnected UDP socket of `pids`."""
    import psutil

    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid not in pids or not c.laddr:
            continue
        if c.status == psutil.CONN_LISTEN:
            found.append((c.pid, c.laddr.ip, c.laddr.port, "tcp"))
        elif c.type == socket.SOCK_DGRAM and not c.raddr:
            found.append((c.pid, c.laddr.ip, c.laddr.port, "udp"))
    return found
