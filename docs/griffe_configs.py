"""A Griffe extension for the API pages (mkdocs.yml): the signature of memlm's configuration classes.

🤗's `PreTrainedConfig` turns every subclass into a dataclass in `__init_subclass__`, so the `__init__` that takes
the config's fields exists only at run time. Griffe reads the source without importing it (importing memlm would pull
in torch and make the docs build slow), so without this extension it sees no parameters, and the config reference
could show neither the fields' types nor their defaults. This builds that `__init__` from the annotated class
attributes, as the dataclass does: keyword-only parameters, in order, with their annotations and defaults.
"""

import griffe

CONFIG_BASE = "PreTrainedConfig"


class ConfigFieldsAsParameters(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs) -> None:
        if not any(str(base).split(".")[-1] == CONFIG_BASE for base in cls.bases) or "__init__" in cls.members:
            return
        fields = [
            member
            for member in cls.members.values()
            if isinstance(member, griffe.Attribute) and member.annotation is not None and member.value is not None
        ]
        parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
        parameters += [
            griffe.Parameter(
                field.name, annotation=field.annotation, kind=griffe.ParameterKind.keyword_only, default=field.value
            )
            for field in fields
        ]
        init = griffe.Function("__init__", parameters=griffe.Parameters(*parameters), returns="None")
        cls.set_member("__init__", init)
