"""labkit.testing.realcluster.NetHosts alone (root, iproute2, util-linux; no Slurm): torch's
TCPStore across h1 and h2 prints no c10d "hostname of the client socket cannot be retrieved"
warning, because the hosts file names each host's IPv4-mapped IPv6 address too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from labkit.testing import realcluster as R

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
                                                              for t in ("ip", "nsenter", "unshare")),
                                reason="network hosts need root, iproute2 and util-linux (nsenter, unshare)")

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
