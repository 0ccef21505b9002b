"""The default time limits of a run, in whole seconds, each written once: the config's defaults (``conf/``) are the
user-facing ones, and every code default that stands in for them where a caller gives none reads these.

* :data:`COLLECTIVE_TIMEOUT_S` (``strategy.timeout_s``): how long a p2p wait or a collective (the process group's
  timeout, the stop agreement's, the launcher's heartbeat watch) waits before it gives up;
* :data:`STOP_TIMEOUT_S` (``stop_timeout_s``): how long the ranks get, after a stop signal, to reach a step boundary,
  save and exit before the launcher kills them.
"""

from __future__ import annotations

COLLECTIVE_TIMEOUT_S = 120
STOP_TIMEOUT_S = 120
