"""Loaded by every Python process of an engine that `scripts/vllm.sh serve
--side-channel-port` starts (it puts this directory on PYTHONPATH).

NIXL's Python API creates its agent with a progress thread that polls without pause
(`pthrDelay = 0`, fixed in nixl's `_api.py`, not reachable from vLLM's config): an idle
engine's worker then burns a whole core. On this 2-core machine two such engines starve
everything else (agents lose their etcd leases, requests take seconds). This hook makes
the thread wait `KVMESH_NIXL_PROGRESS_DELAY_US` microseconds (default 1000) between its
rounds; transfers still progress, vLLM also drives them from its own steps.
"""

import importlib.abc
import importlib.util
import os
import sys

DELAY_US = int(os.environ.get("KVMESH_NIXL_PROGRESS_DELAY_US", "1000"))


def _patch(bindings):
    base = bindings.nixlAgentConfig

    class AgentConfig(base):
        def __setattr__(self, name, value):
            if name == "pthrDelay" and value == 0:
                value = DELAY_US
            super().__setattr__(name, value)

    bindings.nixlAgentConfig = AgentConfig


class _NixlBindingsHook(importlib.abc.MetaPathFinder):
    """Patches `nixl*._bindings` right after it is loaded."""

    def find_spec(self, name, path, target=None):
        if not (name.startswith("nixl") and name.endswith("._bindings")):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if DELAY_US > 0:
    sys.meta_path.insert(0, _NixlBindingsHook())
