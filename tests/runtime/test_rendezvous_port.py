"""The local driver's rendezvous port: free when drawn, and below the kernel's ephemeral
range, where the ports connections take for themselves do not come from."""

from __future__ import annotations

import socket

from src.runtime import driver


def test_a_rendezvous_port_is_drawn_free_below_the_ephemeral_range(tmp_path, monkeypatch):
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("40000\t50000\n")
    monkeypatch.setattr(driver, "EPHEMERAL_RANGE", ephemeral)
    ports = [driver.free_port() for _ in range(20)]
    assert all(40000 - driver.PORT_SPAN <= port < 40000 for port in ports), ports
    assert len(set(ports)) > 1  # drawn, not one fixed port two runs would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # and nothing holds it


def test_without_the_range_the_kernel_picks_the_port(tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "EPHEMERAL_RANGE", tmp_path / "missing")
    port = driver.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
