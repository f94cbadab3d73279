"""A dict that records every key looked up in it, to learn which keys DeepSpeed's config parser reads, and the
default it passes to `get` for a key: the value DeepSpeed works with when the key is not given, whose
type is the one the rest of its code compares the key's value with."""
from __future__ import annotations


class RecordingDict(dict):
    """Records each key looked up in it (and in nested dicts) as a path tuple in `seen`, and in `defaults` the
    default given to `get` for a key (path -> the first default seen)."""

    def __init__(self, data, path=(), seen=None, defaults=None):
        super().__init__(data)
        self._path, self._seen = path, seen
        self._defaults = {} if defaults is None else defaults

    def _child(self, key, value):
        if isinstance(value, dict) and not isinstance(value, RecordingDict):
            value = RecordingDict(value, self._path + (key,), self._seen, self._defaults)
            dict.__setitem__(self, key, value)
        return value

    def __getitem__(self, key):
        self._seen.add(self._path + (key,))
        return self._child(key, dict.__getitem__(self, key))

    def get(self, key, default=None):
        self._seen.add(self._path + (key,))
        self._defaults.setdefault(self._path + (key,), default)
        return self._child(key, dict.__getitem__(self, key)) if dict.__contains__(self, key) else default

    def __contains__(self, key):
        self._seen.add(self._path + (key,))
        return dict.__contains__(self, key)

    def keys(self):  # DeepSpeed also asks `KEY in param_dict.keys()`
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, owner: RecordingDict):
        self._owner = owner

    def __contains__(self, key):
        return key in self._owner

    def __iter__(self):
        return iter(dict.keys(self._owner))

    def __len__(self):
        return len(self._owner)
