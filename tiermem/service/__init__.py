"""The store as a service: ``server`` (``tiermem serve``: runs, requests, recovery, re-placement),
``client`` (a trainer's side), ``protocol`` (JSON over a Unix socket) and ``journal`` (crash safety)."""
