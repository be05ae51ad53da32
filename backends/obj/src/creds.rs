//! Credentials from the AWS shared credentials file (`object_store` reads the
//! environment, instance and container credentials, but no profile files).

use std::path::PathBuf;

/// Keys of one profile: (access key id, secret access key, session token).
pub(crate) type ProfileKeys = (String, String, Option<String>);

/// The keys of profile `AWS_PROFILE` (or `default`) in `AWS_SHARED_CREDENTIALS_FILE`
/// (or `~/.aws/credentials`), when that file has both keys for it.
pub(crate) fn from_profile() -> Option<ProfileKeys> {
    let path = std::env::var_os("AWS_SHARED_CREDENTIALS_FILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".aws/credentials")))?;
    let text = std::fs::read_to_string(path).ok()?;
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    parse(&text, &profile)
}

/// The keys of `profile` in an INI text of the credentials file's format.
pub(crate) fn parse(text: &str, profile: &str) -> Option<ProfileKeys> {
    let (mut access, mut secret, mut token) = (None, None, None);
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim();
            inside = name == profile || name.strip_prefix("profile ") == Some(profile);
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((key, value)) = line.split_once('=') {
            let value = value.trim().to_string();
            match key.trim() {
                "aws_access_key_id" => access = Some(value),
                "aws_secret_access_key" => secret = Some(value),
                "aws_session_token" => token = Some(value),
                _ => {}
            }
        }
    }
    Some((access?, secret?, token))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn reads_the_named_profile_only() {
        let text = "[default]\naws_access_key_id = A\naws_secret_access_key = B\n\n\
                    [profile work]\naws_access_key_id=C\naws_secret_access_key=D\n\
                    aws_session_token = E\n";
        assert_eq!(parse(text, "default"), Some(("A".into(), "B".into(), None)));
        assert_eq!(
            parse(text, "work"),
            Some(("C".into(), "D".into(), Some("E".into())))
        );
        assert_eq!(parse(text, "other"), None);
        assert_eq!(parse("[x]\naws_access_key_id=1\n", "x"), None);
    }
}
