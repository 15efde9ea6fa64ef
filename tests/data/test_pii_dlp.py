"""DLP settings of the PII filter: private-key blocks of any length, the IP scope, counts per type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.cli.main import main
from eyas.data.pii.detectors import detect_ip_addresses
from eyas.data.pii.policy import PiiConfig, PiiFilter
from eyas.data.pii.secrets import detect_private_keys
from eyas.data.pii.types import PII_TYPES, SECRET_TYPES


@pytest.mark.parametrize("label, body", [
    ("RSA", "MIIBOgIBAAJBAK"),
    ("EC", "MHcCAQEE"),
    ("OPENSSH", "b3BlbnNzaC1rZXktdjE="),
    ("ENCRYPTED", "MIIBvTBXBgkq"),
    ("DSA", "MIIBuwIBAAKBgQ"),
    ("", "MC4CAQAwBQYDK2VwBCIEIA"),  # PKCS#8 Ed25519: 22 characters
    ("PGP", "lQOYBGV"),
])
def test_private_key_blocks_with_short_bodies_are_flagged(label: str, body: str) -> None:
    name = f"{label} PRIVATE KEY".strip() + (" BLOCK" if label == "PGP" else "")
    block = f"-----BEGIN {name}-----\n{body}\n-----END {name}-----"
    text = f"my key:\n{block}\nwhy does it fail?"
    findings = detect_private_keys(text)
    assert [(f.type, text[f.start:f.end]) for f in findings] == [("PRIVATE_KEY", block)]


def test_private_key_block_forms_and_near_misses() -> None:
    encrypted_pem = ("-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,3F17\n\n"
                     "Zm9v\n-----END RSA PRIVATE KEY-----")
    assert len(detect_private_keys(encrypted_pem)) == 1
    in_json = '{"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIEvQ\\n-----END PRIVATE KEY-----\\n"}'
    assert [in_json[f.start:f.end] for f in detect_private_keys(in_json)] == \
        ["-----BEGIN PRIVATE KEY-----\\nMIIEvQ\\n-----END PRIVATE KEY-----"]
    cut_off = "it ends here: -----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAA\nAAAB"
    assert [cut_off[f.start:f.end] for f in detect_private_keys(cut_off)] == [cut_off[14:]]
    two = "-----BEGIN EC PRIVATE KEY-----\nAB12\n-----END EC PRIVATE KEY-----\n" * 2
    assert len(detect_private_keys(two)) == 2
    for near_miss in ("-----BEGIN RSA PRIVATE KEY-----\n...\n-----END RSA PRIVATE KEY-----",
                      "-----BEGIN PRIVATE KEY-----\n<your key here>\n-----END PRIVATE KEY-----",
                      "-----BEGIN PRIVATE KEY-----\nYOUR_PRIVATE_KEY_HERE\n-----END PRIVATE KEY-----",
                      "the file starts with -----BEGIN RSA PRIVATE KEY----- and goes on",
                      "-----BEGIN PUBLIC KEY-----\nMIIBIjANBg\n-----END PUBLIC KEY-----"):
        assert detect_private_keys(near_miss) == [], near_miss


INTERNAL = ["10.0.0.5", "192.168.1.20", "172.16.4.2", "127.0.0.1", "203.0.113.7", "198.51.100.23",
            "192.0.2.14", "2001:db8::1", "fe80::1ff:fe23:4567:890a"]
PUBLIC = ["93.184.216.34", "2606:4700:4700::1111"]


def test_ip_scope_all_flags_private_loopback_and_documentation_ranges() -> None:
    text = "hosts: " + ", ".join(INTERNAL + PUBLIC) + "; not 10.0.0.0/8 nor Chrome/110.0.0.0"
    found = {scope: [text[f.start:f.end] for f in detect_ip_addresses(text, scope)] for scope in ("public", "all")}
    assert found["public"] == PUBLIC
    assert sorted(found["all"]) == sorted(INTERNAL + PUBLIC)
    redacted = PiiFilter(PiiConfig(ip_scope="all")).scan("ssh admin@10.1.2.3")
    assert [f.type for f in redacted] == ["IP_ADDRESS"]
    assert PiiFilter(PiiConfig()).scan("ssh admin@10.1.2.3") == []
    with pytest.raises(ValueError, match=r"unknown IP scope 'private' \(accepted: public, all\)"):
        PiiConfig(ip_scope="private")


def test_prepare_cli_ip_scope_and_every_type_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}", "conversations": [{"role": "user", "content": text}]}) + "\n"
                              for i, text in enumerate(["ping 192.168.0.10 please", "mail bob@example.org"])))
    for scope, ip_findings in (("public", 0), ("all", 1)):
        assert main(["data", "prepare", "--source", str(source), "--output-dir", str(tmp_path / scope),
                     "--workers", "1", "--no-progress", "--pii-ip-scope", scope]) == 0
        printed = capsys.readouterr().out
        report = json.loads((tmp_path / scope / "report.json").read_text())["pii"]
        assert list(report["by_type"]) == list(SECRET_TYPES + PII_TYPES)  # zeros included
        assert report["by_type"]["IP_ADDRESS"]["findings"] == ip_findings
        assert f"  IP_ADDRESS       findings {ip_findings:>6}  records {ip_findings:>6}  dropped    0" in printed
        assert "  JWT              findings      0  records      0  dropped    0" in printed
    assert main(["data", "prepare", "--source", str(source), "--output-dir", str(tmp_path / "off"),
                 "--workers", "1", "--no-progress", "--no-pii"]) == 0
    assert "PII: filter off (--no-pii)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_status:
        main(["data", "prepare", "--source", str(source), "--output-dir", str(tmp_path / "x"),
              "--pii-ip-scope", "private"])
    assert exit_status.value.code == 2
    assert "invalid choice: 'private'" in capsys.readouterr().err
