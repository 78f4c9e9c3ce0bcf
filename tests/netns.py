"""Network namespaces for the tests: the helpers live in tandem_cli/netns.py (the TTFT benchmark
uses them too); the marker for tests that need them is here."""

from __future__ import annotations

from tandem_cli.netns import Host, host_namespace, netns_available, sh  # noqa: F401  (the tests' imports)

from .prerequisites import requires

needs_netns = requires(netns_available(), "network namespaces need root and iproute2")
