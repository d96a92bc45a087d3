"""labkit.testing.realcluster.NetHosts alone (root, iproute2, util-linux; no Slurm): torch's
TCPStore across h1 and h2 prints no c10d "hostname of the client socket cannot be retrieved"
warning, because the hosts file names each host's IPv4-mapped IPv6 address too; a shaped link
(tbf on both ends) carries a TCP transfer at its set rate within 10 %, also after the rate was
changed while the hosts run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from labkit.testing import realcluster as R

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
                                                              for t in ("ip", "tc", "nsenter", "unshare")),
                                reason="network hosts need root, iproute2 (ip, tc) and util-linux (nsenter, unshare)")

SERVER = ("import datetime, time, torch.distributed as d\n"
          "s = d.TCPStore('10.200.0.1', 29561, 2, True, timeout=datetime.timedelta(seconds=60))\n"
          "s.set('k', 'v'); s.wait(['done']); print('server ok')")
CLIENT = ("import datetime, torch.distributed as d\n"
          "s = d.TCPStore('10.200.0.1', 29561, 2, False, timeout=datetime.timedelta(seconds=60))\n"
          "print('client got', s.get('k').decode()); s.set('done', '1')")


def test_tcpstore_across_the_hosts_without_hostname_warnings(tmp_path):
    assert "::ffff:10.200.0.2 h2" in R.hosts_text().splitlines()
    with R.NetHosts(tmp_path / "net") as hosts:
        server = subprocess.Popen(hosts.wrap("h1") + [sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        client = subprocess.run(hosts.wrap("h2") + [sys.executable, "-c", CLIENT], capture_output=True, text=True,
                                timeout=120)
        out, err = server.communicate(timeout=120)
    assert client.returncode == 0 and "client got v" in client.stdout, client.stderr[-2000:]
    assert server.returncode == 0 and "server ok" in out, err[-2000:]
    for text in (err, client.stderr):
        assert "hostname of the client socket" not in text, text[-2000:]


@pytest.mark.exclusive  # a measured rate within 10 % of the set one
def test_shaped_link_carries_its_set_rate(tmp_path, say):
    """A bounded TCP transfer h1 -> h2 (about 2 s of the rate, only the hosts' own addresses):
    bytes over the receiver's time within 10 % of the tbf rate, at 200 Mbit/s set at start and
    at 50 Mbit/s and 1 Gbit/s set with ``tc qdisc change`` while the hosts run; unshaped, the
    veth is far faster (memory speed)."""
    with R.NetHosts(tmp_path / "net", rate_bits=200e6) as hosts:
        assert all("tbf" in hosts.qdisc(h) and "rate 200Mbit" in hosts.qdisc(h) for h in hosts.names)
        seen = {}
        for rate, shown in ((200e6, "200Mbit"), (50e6, "50Mbit"), (1e9, "1Gbit")):
            hosts.shape(rate)
            assert f"rate {shown} " in hosts.qdisc("h2")  # both ends changed in place
            res = R.measure_throughput(hosts, int(rate / 8 * 2))
            seen[rate] = res
            assert abs(res["goodput_bits"] / rate - 1) <= 0.10, (rate, res)
            assert res["wire_bits"] >= res["goodput_bits"]  # frames carry the payload and headers
        hosts.shape(None)
        assert "tbf" not in hosts.qdisc("h1")
        free = R.measure_throughput(hosts, 500_000_000)
    say("\n[shaped link] " + "; ".join(f"{r / 1e6:g} Mbit/s set: {v['goodput_bits'] / 1e6:.1f} measured"
                                      for r, v in seen.items()) + f"; unshaped {free['goodput_bits'] / 1e6:.0f}")
    assert free["goodput_bits"] > 2e9


def test_shape_refuses_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="rate_bits"):
        R.NetHosts(tmp_path, rate_bits=0)
    with pytest.raises(ValueError, match="latency"):
        R.NetHosts(tmp_path, rate_bits=1e6, latency=0)


def test_network_sweep_writes_the_parquet_beside_the_model(tmp_path):
    """`labkit sweep network` end to end on the tiny model: 2 ranks across h1/h2 unshaped and at
    20 Mbit/s (the tiny model's 0.6 MB of gradients then take ~0.25 s a step, over its compute),
    every column of sweeps/network.parquet filled; the bytes per step are the model's fp32
    gradients, the shaped point is slower than the unshaped one and its exposed communication
    is most of the difference; each setting's 1-rank compute time is measured beside it. Run
    again, the sweep reads every point back and says so."""
    import polars as pl

    from tiny_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", n_sequences=64)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'workdir = "{tmp_path / "work"}"\n[train]\nmodel = "tiny"\nmicro_batch_size = 4\n'
                   f'data_dir = "{shards}"\nrun_dir = "{tmp_path / "run"}"\n')
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "sweep", "network", str(cfg), "--rates-mbit", "0", "20",
                          "--steps", "4"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    df = pl.read_parquet(tmp_path / "work" / "sweeps" / "network.parquet")
    assert df.height == 2 and df["rate_mbit"].to_list() == [None, 20.0]
    assert df.null_count().drop("rate_mbit").sum_horizontal().item() == 0
    assert (df["comm_bytes"] == 4 * df["params"]).all()
    free, shaped = df.row(0, named=True), df.row(1, named=True)
    assert abs(shaped["link_mbit"] / 20 - 1) < 0.1
    assert shaped["step_s"] > free["step_s"] and shaped["comm_exposed_s"] > free["comm_exposed_s"]
    assert shaped["predicted_step_s"] > free["predicted_step_s"]
    # gloo's CPU rate of the all-reduce, measured once per model on one host, in both rows
    assert free["collective_mbyte_s"] > 0 and free["collective_mbyte_s"] == shaped["collective_mbyte_s"]
    # the 1-rank compute beside each link setting is its own measurement (fresh runs), not one reused
    assert free["compute_s"] != shaped["compute_s"] and free["compute_s_hosts"] != shaped["compute_s_hosts"]
    # the same sweep again: every point read back, said in one line with when and at what load
    again = subprocess.run([sys.executable, "-m", "labkit.cli", "sweep", "network", str(cfg), "--rates-mbit", "0",
                            "20", "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "sweep network: 2 of 2 points reused from earlier runs (measured 20" in again.stderr, again.stderr
    assert pl.read_parquet(tmp_path / "work" / "sweeps" / "network.parquet").equals(df)


def test_the_machine_lock_makes_a_second_process_wait_and_names_the_holder(tmp_path):
    """Two checkouts' suites on one machine: the second cluster waits for the first, and after a
    timeout says which pid holds the machine (not a teardown of the first one's hosts)."""
    lock = R.MachineLock(tmp_path / "cluster.lock")
    lock.acquire()
    lock.acquire()  # reentrant in one process
    code = ("import sys, labkit.testing.realcluster as R\n"
            "try:\n    R.MachineLock(sys.argv[1]).acquire(timeout=1)\n"
            "except TimeoutError as e:\n    print(e)\n    sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cluster.lock")], capture_output=True, text=True)
    assert out.returncode == 3, out.stderr
    assert f"pid {os.getpid()}" in out.stdout
    lock.release()
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cluster.lock")], capture_output=True, text=True)
    assert out.returncode == 3  # still held once
    lock.release()
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cluster.lock")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
