"""Counting the ATen operations a piece of code dispatches (what a decoding step runs, which path a product takes)."""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CountOperations(TorchDispatchMode):
    """Inside `with CountOperations() as operations:`, each ATen operation dispatched while `counting` is counted by
    its name (`by_name`, e.g. "mv", "addmm"; `total` for all of them)."""

    def __init__(self):
        super().__init__()
        self.by_name, self.counting = Counter(), True

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, function, types, arguments=(), keywords=None):
        if self.counting:
            self.by_name[function.overloadpacket.__name__] += 1
        return function(*arguments, **(keywords or {}))
