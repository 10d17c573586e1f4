//! `#[derive(ModelArgs)]`: one declaration of a model-args struct gives its Hugging Face
//! `config.json` import and export and its per-field checks (the SDK's `kit::ModelArgs` trait).
//!
//! Each field says, in `#[arg(..)]`:
//! - `hf = "hidden_size"`: its `config.json` key (read typed, written back on export);
//! - `default = <expr>`: its value when the key is absent (may name earlier fields);
//! - `rope = theta | llama3 | yarn`: a part of the RoPE settings, read together
//!   (`rope_parameters` or `rope_theta` + `rope_scaling`) and checked together;
//! - `nested`: a struct (or `Option` of one) deriving `ModelArgs` itself, written into the same
//!   object and checked under `<field>.`; an `Option` reads as `None` (the plugin decides);
//! - `json`: read and written through serde (enums, lists of them);
//! - `import_only`: read but not written on export;
//! - checks: `min = N`, `non_negative`, `positive` (finite numbers), `even`, `one_of("a", "b")`.
//!
//! A field without `hf`, `rope` or `nested` is not in `config.json`: it takes its `default` (or
//! `Default::default()`), and the plugin's own reader sets it.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::quote;
use syn::{parse_macro_input, Data, DeriveInput, Expr, Fields, Ident, LitInt, LitStr, Type};

/// Derives `anneal_plugin_api::sdk::kit::ModelArgs`; see the crate docs for `#[arg(..)]`.
#[proc_macro_derive(ModelArgs, attributes(arg))]
pub fn derive_model_args(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

#[derive(Default)]
struct FieldArgs {
    hf: Option<LitStr>,
    default: Option<Expr>,
    rope: Option<Ident>,
    nested: bool,
    json: bool,
    import_only: bool,
    min: Option<LitInt>,
    non_negative: bool,
    positive: bool,
    even: bool,
    one_of: Vec<LitStr>,
}

fn field_args(field: &syn::Field) -> syn::Result<FieldArgs> {
    let mut a = FieldArgs::default();
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("arg")) {
        attr.parse_nested_meta(|meta| {
            let p = &meta.path;
            if p.is_ident("hf") {
                a.hf = Some(meta.value()?.parse()?);
            } else if p.is_ident("default") {
                a.default = Some(meta.value()?.parse()?);
            } else if p.is_ident("rope") {
                let part: Ident = meta.value()?.parse()?;
                if !["theta", "llama3", "yarn"].iter().any(|k| part == k) {
                    return Err(meta.error("rope = theta | llama3 | yarn"));
                }
                a.rope = Some(part);
            } else if p.is_ident("min") {
                a.min = Some(meta.value()?.parse()?);
            } else if p.is_ident("one_of") {
                let content;
                syn::parenthesized!(content in meta.input);
                let list = content.parse_terminated(|s| s.parse::<LitStr>(), syn::Token![,])?;
                a.one_of = list.into_iter().collect();
            } else {
                let flag = match p.get_ident().map(|i| i.to_string()).as_deref() {
                    Some("nested") => &mut a.nested,
                    Some("json") => &mut a.json,
                    Some("import_only") => &mut a.import_only,
                    Some("non_negative") => &mut a.non_negative,
                    Some("positive") => &mut a.positive,
                    Some("even") => &mut a.even,
                    _ => return Err(meta.error("unknown #[arg] setting")),
                };
                *flag = true;
            }
            Ok(())
        })?;
    }
    Ok(a)
}

/// Whether `ty` is written `Option<..>`.
fn is_option(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Option"))
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(input, "ModelArgs needs a struct"));
    };
    let Fields::Named(fields) = &data.fields else {
        return Err(syn::Error::new_spanned(
            input,
            "ModelArgs needs named fields",
        ));
    };
    let kit = quote!(::anneal_plugin_api::sdk::kit);
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    let mut checks = Vec::new();
    let mut names = Vec::new();
    let mut rope_default = None;
    let mut rope_parts: Vec<(Ident, Ident)> = Vec::new();
    for field in &fields.named {
        let name = field.ident.clone().expect("named field");
        let ty = &field.ty;
        let a = field_args(field)?;
        let label = name.to_string();
        let hint = match &a.hf {
            Some(k) => format!(" ({} in config.json)", k.value()),
            None => String::new(),
        };
        names.push(name.clone());
        // Import.
        let read = if let Some(part) = &a.rope {
            if part == "theta" {
                rope_default = Some(a.default.clone().unwrap_or(syn::parse_quote!(10_000.0)));
            }
            rope_parts.push((part.clone(), name.clone()));
            quote!(__rope.#part.clone())
        } else if a.nested && is_option(ty) {
            quote!(::core::option::Option::None)
        } else if a.nested {
            quote!(<#ty as #kit::ModelArgs>::from_hf(__f)?)
        } else if let Some(key) = &a.hf {
            let raw = if a.json {
                quote!(__f.json::<#ty>(#key)?)
            } else {
                quote!(<#ty as #kit::HfField>::read(__f, #key)?)
            };
            let kind = if a.json {
                quote!("value")
            } else {
                quote!(<#ty as #kit::HfField>::KIND)
            };
            let fallback = match (&a.default, a.json) {
                (Some(d), _) => quote!(#d),
                (None, true) => {
                    quote!(return ::core::result::Result::Err(__f.missing(#key, #kind)))
                }
                (None, false) => quote!(<#ty as #kit::HfField>::absent()
                    .ok_or_else(|| __f.missing(#key, #kind))?),
            };
            quote!(match #raw { ::core::option::Option::Some(v) => v, ::core::option::Option::None => #fallback })
        } else {
            match &a.default {
                Some(d) => quote!(#d),
                None => quote!(::core::default::Default::default()),
            }
        };
        reads.push(quote!(let #name: #ty = #read;));
        // Export.
        if a.nested && is_option(ty) {
            writes.push(quote!(
                if let ::core::option::Option::Some(m) = &self.#name { #kit::ModelArgs::write_hf(m, __out); }
            ));
        } else if a.nested {
            writes.push(quote!(#kit::ModelArgs::write_hf(&self.#name, __out);));
        } else if let (Some(key), false) = (&a.hf, a.import_only) {
            writes.push(if a.json {
                quote!(
                    if let ::core::result::Result::Ok(v) = ::anneal_plugin_api::serde_json::to_value(&self.#name) {
                        __out.insert(#key.into(), v);
                    }
                )
            } else {
                quote!(
                    if let ::core::option::Option::Some(v) = #kit::HfField::to_json(&self.#name) {
                        __out.insert(#key.into(), v);
                    }
                )
            });
        }
        // Checks.
        if a.nested {
            let each = if is_option(ty) {
                quote!(self.#name.iter())
            } else {
                quote!(::core::iter::once(&self.#name))
            };
            checks.push(quote!(
                for m in #each {
                    #kit::ModelArgs::check_at(m, &format!("{__prefix}{}.", #label))?;
                }
            ));
        }
        if let Some(min) = &a.min {
            checks.push(quote!(#kit::check::min(&self.#name, #min, __prefix, #label, #hint)?;));
        }
        for (on, f) in [
            (a.non_negative, quote!(non_negative)),
            (a.positive, quote!(positive)),
            (a.even, quote!(even)),
        ] {
            if on {
                checks.push(quote!(#kit::check::#f(&self.#name, __prefix, #label, #hint)?;));
            }
        }
        if !a.one_of.is_empty() {
            let allowed = &a.one_of;
            checks.push(quote!(
                #kit::check::one_of(&self.#name, &[#(#allowed),*], __prefix, #label)?;
            ));
        }
    }
    let rope_read = match &rope_default {
        Some(d) => quote!(let __rope = __f.rope(#d)?;),
        None if rope_parts.is_empty() => quote!(),
        None => {
            return Err(syn::Error::new_spanned(
                input,
                "a rope part needs the field of `rope = theta`",
            ))
        }
    };
    let rope_value = |part: &str| match rope_parts.iter().find(|(p, _)| p == part) {
        Some((_, f)) => quote!(self.#f.clone()),
        None if part == "theta" => quote!(0.0),
        None => quote!(::core::option::Option::None),
    };
    let (theta, llama3, yarn) = (
        rope_value("theta"),
        rope_value("llama3"),
        rope_value("yarn"),
    );
    let rope_fn = if rope_parts.is_empty() {
        quote!()
    } else {
        quote!(
            fn hf_rope(&self) -> ::core::option::Option<::anneal_plugin_api::sdk::HfRope> {
                ::core::option::Option::Some(::anneal_plugin_api::sdk::HfRope {
                    theta: #theta, llama3: #llama3, yarn: #yarn,
                })
            }
        )
    };
    let ident = &input.ident;
    let (impl_g, ty_g, where_g) = input.generics.split_for_impl();
    Ok(quote! {
        impl #impl_g #kit::ModelArgs for #ident #ty_g #where_g {
            fn from_hf(__f: &::anneal_plugin_api::sdk::HfConfig<'_>)
                -> ::core::result::Result<Self, ::std::string::String> {
                #rope_read
                #(#reads)*
                ::core::result::Result::Ok(#ident { #(#names),* })
            }

            fn write_hf(&self, __out: &mut ::anneal_plugin_api::serde_json::Map<
                ::std::string::String, ::anneal_plugin_api::serde_json::Value>) {
                #(#writes)*
                if let ::core::option::Option::Some(r) = #kit::ModelArgs::hf_rope(self) {
                    #kit::write_rope(&r, __out);
                }
            }

            fn check_at(&self, __prefix: &str) -> ::core::result::Result<(), ::std::string::String> {
                #(#checks)*
                if let ::core::option::Option::Some(r) = #kit::ModelArgs::hf_rope(self) {
                    r.validate()?;
                }
                ::core::result::Result::Ok(())
            }

            #rope_fn
        }
    })
}
