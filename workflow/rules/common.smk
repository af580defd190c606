import json


def section_json(*names):
    """The named config sections as JSON; editing any of them reruns the jobs that get them."""
    return json.dumps({name: config.get(name, {}) for name in names}, sort_keys=True)
