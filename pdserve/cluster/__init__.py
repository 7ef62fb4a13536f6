"""Cluster layer: the scenario -> prefill/decode instance registry (ZooKeeper or in-process)."""
