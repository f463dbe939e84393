from __future__ import annotations

from rich.table import Table

from .common import JsonOption, out, print_json


def recipes_command(json_: bool = JsonOption):
    from ..recipe import list_recipes

    items = list_recipes()
    if json_:
        print_json(items)
        return
    t = Table("recipe", "source", "description")
    for r in items:
        t.add_row(r["name"], r["source"], r["description"])
    out.print(t)


def models_command(json_: bool = JsonOption):
    from ..models.registry import all_families

    rows = [{"family": name, "architectures": list(cls.architectures), "multi_image": cls.multi_image,
             "video": cls.video} for name, cls in all_families().items()]
    if json_:
        print_json(rows)
        return
    t = Table("family", "architectures", "multi-image", "video")
    for r in rows:
        t.add_row(r["family"], ", ".join(r["architectures"]), "yes" if r["multi_image"] else "no",
                  "yes" if r["video"] else "no")
    out.print(t)
