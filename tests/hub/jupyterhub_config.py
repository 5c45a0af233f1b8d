"""The configuration of the JupyterHub that tests/hub/conftest.py starts (as root).

Everything that changes from run to run (ports, tokens, users, the command) comes from
settings.json in the hub's directory, $JGS_HUB_DIR, written by the fixture. What the users'
servers get at spawn time (command, arguments, environment) is read again from spawn.json at
every spawn, so tests change it without restarting the hub.
"""

import json
import os
import pwd
from pathlib import Path

from traitlets.config import Config

c = get_config()  # noqa: F821 - JupyterHub's config loader defines it

hub_dir = Path(os.environ["JGS_HUB_DIR"])
settings = json.loads((hub_dir / "settings.json").read_text())

# Loopback only, on the ports the fixture found free: several runs may share a machine.
c.JupyterHub.bind_url = f"http://127.0.0.1:{settings['proxy_port']}/"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = settings["hub_port"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{settings['proxy_api_port']}"
c.ConfigurableHTTPProxy.command = [settings["proxy_command"]]
c.ConfigurableHTTPProxy.pid_file = str(hub_dir / "proxy.pid")
c.JupyterHub.pid_file = str(hub_dir / "hub.pid")
c.JupyterHub.db_url = f"sqlite:///{hub_dir / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(hub_dir / "cookie_secret")
c.JupyterHub.log_level = settings["log_level"]

# Shared-password is what 'dummy' with a password became in JupyterHub 5.3: a browser login
# for people looking at a failing run. The tests themselves use API tokens.
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = settings["password"]
c.Authenticator.allowed_users = set(settings["users"])

# The test's own client: an admin token, to start and stop servers and issue user tokens.
c.JupyterHub.services = [{"name": settings["service"], "api_token": settings["service_token"]}]
c.JupyterHub.load_roles = [{"name": "admin", "services": [settings["service"]]}]

# Root hub, unprivileged servers: LocalProcessSpawner setuids to the user before exec.
c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
c.Spawner.cmd = settings["cmd"]
# A loaded two-core machine imports jupyter_server and the extensions slowly.
c.Spawner.start_timeout = settings["start_timeout"]
c.Spawner.http_timeout = settings["start_timeout"]
# Only these reach the users' servers from the hub's environment: PATH finds criu in
# /usr/local/sbin; the proxy's token and anything of the test process stay out.
c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL"]


def pre_spawn(spawner):
    """Command, arguments and environment of this spawn, from the fixture's spawn.json."""
    spawn = json.loads((hub_dir / "spawn.json").read_text())
    name = spawner.user.name
    mine = spawn["users"].get(name, {})
    home = pwd.getpwnam(name).pw_dir
    spawner.cmd = mine.get("cmd") or spawn["cmd"]
    spawner.args = [
        f"--ServerApp.root_dir={home}/{settings['notebooks']}",
        *spawn["args"],
        *mine.get("args", []),
    ]
    spawner.environment = {
        **spawner.environment, **spawn["environment"], **mine.get("environment", {})
    }


c.Spawner.pre_spawn_hook = pre_spawn

# Whatever a test module adds (its hub_config fixture), last, over all of the above.
c.merge(Config(settings["config"]))
